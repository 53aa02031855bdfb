package compat

import (
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/internal/testwatch"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/vmihailenco/msgpack/v5"
	"go.uber.org/goleak"
)

var update = flag.Bool("update", false, "rewrite the golden answers in testdata/golden")

func TestMain(m *testing.M) {
	testwatch.Start()
	goleak.VerifyTestMain(testwatch.Settled(m, testwatch.NodeIgnores()...), testwatch.NodeIgnores()...)
}

var quiet = slog.New(slog.DiscardHandler)

var _ Router = (*api.Server)(nil)

// testNode is a real single-node cluster serving /v1 and the compatible
// APIs at the root, over HTTP.
type testNode struct {
	node    *raftfsm.Node
	url     string
	handler http.Handler // what url serves
}

func startNode(t testing.TB) *testNode {
	t.Helper()
	return startNodeWith(t, api.Options{})
}

// startNodeWith is startNode with the server's options opts.
func startNodeWith(t testing.TB, opts api.Options) *testNode {
	t.Helper()
	return startNodeAs(t, opts, nil)
}

// startNodeAs is startNodeWith with the compatible APIs served on
// wrap(node) (nil: the node itself): a node that answers a method of its
// own, such as CheckLeader, while the rest of the node serves as it is.
func startNodeAs(t testing.TB, opts api.Options, wrap func(*raftfsm.Node) SelectionBackend) *testNode {
	t.Helper()
	var handler http.Handler
	hs := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		handler.ServeHTTP(w, r)
	}))
	httpAddr := hs.Listener.Addr().String()
	raftAddr, tr := raft.NewInmemTransport("")
	node, err := raftfsm.NewNode(raftfsm.Config{
		ID: "n1", RaftAddr: string(raftAddr), HTTPAddr: httpAddr, DataDir: t.TempDir(),
		Peers:     []raftfsm.Member{{ID: "n1", RaftAddr: string(raftAddr), HTTPAddr: httpAddr, Voter: true}},
		Transport: tr, Logger: quiet,
	})
	if err != nil {
		t.Fatal(err)
	}
	opts.Logger = quiet
	srv := api.NewServer(node, opts)
	var b SelectionBackend = node
	if wrap != nil {
		b = wrap(node)
	}
	NewIndexer(b, quiet).Routes(srv, "")
	NewSelection(b, quiet).Routes(srv, SelectionPrefix)
	handler = srv
	hs.Start()
	t.Cleanup(func() {
		hs.Close()
		srv.Close()
		node.Close()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := node.WaitReady(ctx); err != nil {
		t.Fatalf("the node did not get ready: %v", err)
	}
	return &testNode{node: node, url: hs.URL, handler: srv}
}

// selectionPort serves n's selection API at the root of a listener of its
// own (SelectionHandler, kvrouter --selection-addr).
func (n *testNode) selectionPort(t testing.TB) *testNode {
	t.Helper()
	hs := httptest.NewServer(SelectionHandler(n.handler))
	t.Cleanup(hs.Close)
	return &testNode{node: n.node, url: hs.URL, handler: hs.Config.Handler}
}

// reply is one answer: status, content type and body.
type reply struct {
	code  int
	ctype string
	body  []byte
	hdr   http.Header
}

// do sends body (a Go value, or nil) in encoding c and returns the answer.
// A []byte body is sent as it is.
func (n *testNode) do(t testing.TB, c codec, method, path string, body any) reply {
	t.Helper()
	var rd io.Reader
	var ctype string
	if body != nil {
		var b []byte
		switch v := body.(type) {
		case []byte:
			b = v
		default:
			var err error
			if c == codecMsgpack {
				var buf bytes.Buffer
				e := msgpack.NewEncoder(&buf)
				e.SetCustomStructTag("json")
				err = e.Encode(v)
				b = buf.Bytes()
			} else {
				b, err = json.Marshal(v)
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		rd = bytes.NewReader(b)
		ctype = contentJSON
		if c == codecMsgpack {
			ctype = contentMsgpack
		}
	}
	req, err := http.NewRequest(method, n.url+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	} else if c == codecMsgpack {
		req.Header.Set("Accept", contentMsgpack)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return reply{code: resp.StatusCode, ctype: resp.Header.Get("Content-Type"), body: b, hdr: resp.Header}
}

// asJSON decodes an answer of either encoding into plain JSON values, so
// that the two encodings' answers can be compared.
func (r reply) asJSON(t testing.TB) any {
	t.Helper()
	var v any
	switch r.ctype {
	case contentMsgpack:
		d := msgpack.NewDecoder(bytes.NewReader(r.body))
		d.SetMapDecoder(func(d *msgpack.Decoder) (any, error) { return d.DecodeMap() })
		d.UseLooseInterfaceDecoding(true)
		if err := d.Decode(&v); err != nil {
			t.Fatalf("msgpack answer %x: %v", r.body, err)
		}
		// Through JSON, so numbers compare as JSON numbers do.
		b, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		r.body = b
		fallthrough
	default:
		d := json.NewDecoder(bytes.NewReader(r.body))
		d.UseNumber()
		if err := d.Decode(&v); err != nil {
			t.Fatalf("json answer %q: %v", r.body, err)
		}
	}
	return v
}

// golden compares the answer with testdata/golden/<name>.<json|msgpack>,
// or rewrites it with -update. A MessagePack golden is hex.
func golden(t *testing.T, name string, c codec, r reply) {
	t.Helper()
	ext, body := "json", string(r.body)
	if c == codecMsgpack {
		ext, body = "msgpack", hex.EncodeToString(r.body)+"\n"
	}
	got := fmt.Sprintf("%d %s\n%s", r.code, r.ctype, body)
	path := filepath.Join("testdata", "golden", name+"."+ext)
	if *update {
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test ./compat -run Golden -update to write it)", err)
	}
	if string(want) != got {
		t.Errorf("%s: answer differs from the golden file\n got: %s\nwant: %s", path, got, strings.TrimSpace(string(want)))
	}
}

// queryPrompt is node n's /query answer for prompt in model llama's group
// ("" the default).
func queryPrompt(t *testing.T, n *testNode, group string) QueryResponse {
	t.Helper()
	r := n.do(t, codecJSON, "POST", "/query", QueryRequest{TokenIDs: prompt, ModelName: "llama", RoutingGroup: group})
	mustCode(t, r, 200, "query")
	var q QueryResponse
	if err := json.Unmarshal(r.body, &q); err != nil {
		t.Fatal(err)
	}
	return q
}

// postEvents posts evs for instance 1 of model llama and returns the acks.
func postEvents(t *testing.T, n *testNode, evs ...Event) EventsResponse {
	t.Helper()
	r := n.do(t, codecJSON, "POST", "/events", EventsRequest{InstanceID: 1, ModelName: "llama", Events: evs})
	mustCode(t, r, 200, "events")
	var er EventsResponse
	if err := json.Unmarshal(r.body, &er); err != nil {
		t.Fatal(err)
	}
	return er
}

// selectOn posts req to the selection route path ("/selection/select" or
// "/selection/select_and_reserve") of n and returns the choice.
func selectOn(t *testing.T, n *testNode, path string, req SelectRequest) SelectResponse {
	t.Helper()
	r := n.do(t, codecJSON, "POST", path, req)
	mustCode(t, r, 200, path)
	var s SelectResponse
	if err := json.Unmarshal(r.body, &s); err != nil {
		t.Fatal(err)
	}
	return s
}
