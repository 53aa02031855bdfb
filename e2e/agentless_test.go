package e2e

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/compat"
	"github.com/kvrouter/kvrouter/internal/pypub"
	"github.com/kvrouter/kvrouter/kvevent"
)

// postJSON posts body to node n's path and returns the status and answer.
func postJSON(t *testing.T, n *node, path, body string) (int, []byte) {
	t.Helper()
	return postJSONWithin(t, n, path, body, 0)
}

// postJSONWithin is postJSON bounded by d (none when 0): a call that has
// no answer within d returns 0 and the error, as a failed one does.
func postJSONWithin(t *testing.T, n *node, path, body string, d time.Duration) (int, []byte) {
	t.Helper()
	ctx := context.Background()
	if d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
	}
	req, err := http.NewRequestWithContext(ctx, "POST", "http://"+n.httpAddr+path, bytes.NewBufferString(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, []byte(err.Error())
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// TestAgentlessEndToEnd: a Python engine publisher registered through the
// compatible POST /register is followed by the cluster's leader itself (no
// agent). Every node's POST /query answers the same; after a kill -9 of
// the leader while the engine streams, the new leader resumes through the
// replay socket and every node again holds exactly what the engine does.
func TestAgentlessEndToEnd(t *testing.T) {
	pypub.Require(t)
	seed := testSeed(t)
	c := startCluster(t, 3)
	pub := pypub.Start(t, pypub.Config{Pub: "tcp://127.0.0.1:*", Replay: "tcp://127.0.0.1:*", ReplayShape: 2})
	// The engine salts its block hashes: queries find them with its salt.
	reg := fmt.Sprintf(`{"instance_id":7,"endpoint":%q,"replay_endpoint":%q,"model_name":"m","block_size":%d,"additional_salt":"tenant-b"}`,
		pub.Pub, pub.Replay, agentBlockSize)
	var code int
	var body []byte
	c.waitFor(readyTimeout, "the registration answered by a leader", func() (bool, string) {
		code, body = postJSON(t, c.nodes[0], "/register", reg)
		return code != 503 && code != 0, string(body) // 503: an election; retry as a client does
	})
	if code != 201 {
		t.Fatalf("register: %d %s", code, body)
	}
	pub.WaitSub()
	id := compat.WorkerID(7, "m", compat.DefaultTenant)

	g := newEngineGen(seed)
	g.salt = "tenant-b"
	var seq uint64
	publishBatches(pub, g, &seq, 60)
	waitModelOf(c, g, id)
	// POST /query on every node: the same answer, naming the instance.
	// A chain whose first block the engine still holds in some tier (the
	// generator trims GPU tails, so some chains are gone).
	var prompt []uint32
	for _, ch := range g.chains {
		if g.model[kvevent.TierDevice][ch[0]] || g.model[kvevent.TierHostPinned][ch[0]] {
			for _, h := range ch {
				prompt = append(prompt, g.tokens[h]...)
			}
			break
		}
	}
	if prompt == nil {
		t.Fatal("the engine holds no chain: the generator made nothing to query")
	}
	q := fmt.Sprintf(`{"token_ids":%s,"model_name":"m","cache_salt":"tenant-b"}`, jsonInts(prompt))
	var first []byte
	for i, n := range c.nodes {
		code, ans := postJSON(t, n, "/query", q)
		if code != 200 || !bytes.Contains(ans, []byte(`"7":`)) {
			t.Fatalf("node %d query: %d %s", i, code, ans)
		}
		if first == nil {
			first = ans
		} else if !bytes.Equal(ans, first) {
			t.Fatalf("node %d answers %s, node 0 %s", i, ans, first)
		}
	}

	publishBatches(pub, g, &seq, 40)
	c.killLeader()
	publishBatches(pub, g, &seq, 80)
	waitModelOf(c, g, id)
}

func jsonInts(v []uint32) string {
	var b bytes.Buffer
	b.WriteByte('[')
	for i, x := range v {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprint(&b, x)
	}
	b.WriteByte(']')
	return b.String()
}
