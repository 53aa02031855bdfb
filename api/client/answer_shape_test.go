package client_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/client"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// TestAnswersOfAnotherShapeAreRefused: a success answer in JSON that holds
// nothing of what a node's answer to the request does ({"foo":1}, from
// another service at that address) is client.ErrNotAnAnswer, where it
// decoded into an empty members or workers list, zero index stats, a
// status of no node, a route to worker 0 and a node that is not ready; a
// node's answer with empty lists (null or []) is one.
func TestAnswersOfAnotherShapeAreRefused(t *testing.T) {
	body := `{"foo":1}`
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, body+"\n")
	}))
	defer srv.Close()
	c, err := client.New([]string{srv.URL}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	calls := readCalls(c)
	calls["StatusAll"] = func() error { return c.StatusAll(context.Background())[0].Err }
	for name, call := range calls {
		if err := call(); !errors.Is(err, client.ErrNotAnAnswer) {
			t.Errorf("%s of %s: %v, want ErrNotAnAnswer", name, body, err)
		}
	}
	for name, b := range map[string]string{
		"Status":     `{"id":"n1","state":"Follower"}`,
		"StatusAll":  `{"id":"","state":"Candidate"}`,
		"Members":    `{"members":null}`,
		"Workers":    `{"workers":[]}`,
		"IndexStats": `{"nodes":0,"ranks":0,"entries":0}`,
		"Route":      `{"worker_id":0,"dp_rank":0,"decided_by":"cost","block_size":16}`,
		"Ready":      `{"ready":true,"state":"Follower","applied_index":0}`,
	} {
		body = b
		if err := calls[name](); err != nil {
			t.Errorf("%s of %s: %v, want a node's answer", name, b, err)
		}
	}
}

// TestAnAnswerOfAnotherShapeNamesItsEndpoint: with several endpoints, the
// error of an answer of another shape names the endpoint that sent it, as
// an error answer's and an answer in another protocol's do (kvctl then
// says "that address is not a node's HTTP API": which one?). The
// endpoint listed first does not answer, so the answer comes from the
// second. From the review of 8c9cf45: the error named no endpoint.
func TestAnAnswerOfAnotherShapeNamesItsEndpoint(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"foo":1}`+"\n")
	}))
	defer srv.Close()
	other := srv.Listener.Addr().String()
	c, err := client.New([]string{deadAddr(t), other}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for name, call := range readCalls(c) {
		if err := call(); !errors.Is(err, client.ErrNotAnAnswer) || !strings.Contains(err.Error(), other) {
			t.Errorf("%s, the second endpoint %s answering {\"foo\":1}: %v; want ErrNotAnAnswer naming %s", name, other, err, other)
		}
	}
}

// readCalls returns, by name, a call of each client method that reads an
// answer whose shape the client checks.
func readCalls(c *client.Client) map[string]func() error {
	ctx := context.Background()
	return map[string]func() error{
		"Status":     func() error { _, err := c.Status(ctx); return err },
		"Members":    func() error { _, err := c.Members(ctx); return err },
		"Workers":    func() error { _, err := c.Workers(ctx); return err },
		"IndexStats": func() error { _, err := c.IndexStats(ctx); return err },
		"Route": func() error {
			_, err := c.Route(ctx, api.RouteRequest{BlockHashes: []uint64{1}})
			return err
		},
		"Ready": func() error { _, err := c.Ready(ctx); return err },
	}
}

// TestAReadPassesOnFromAnAnswerOfAnotherShape: an endpoint that answers
// success in JSON of another shape (another service's API) listed before
// a node is passed over, as one that answers in another protocol is: each
// read gets the node's answer, nothing the other service's answer set
// stays in it, and the client does not go on preferring that endpoint
// (it is asked once, by the first call). Before, the read failed there
// with ErrNotAnAnswer, and every later call went to it first.
func TestAReadPassesOnFromAnAnswerOfAnotherShape(t *testing.T) {
	var otherHits atomic.Int64
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		otherHits.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		// Fields of a node's status, but neither its id nor its state.
		_, _ = io.WriteString(w, `{"leader_id":"elsewhere","term":9}`+"\n")
	}))
	defer other.Close()
	node := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		body := map[string]string{
			"/v1/cluster/status":  `{"id":"n1","state":"Follower"}`,
			"/v1/cluster/members": `{"members":[{"id":"n1"}]}`,
			"/v1/workers":         `{"workers":[]}`,
			"/v1/index/stats":     `{"nodes":3,"ranks":1,"entries":4}`,
			"/v1/route":           `{"worker_id":7,"dp_rank":0,"decided_by":"cost","block_size":16}`,
			"/readyz":             `{"ready":true,"state":"Follower","applied_index":5}`,
		}[r.URL.Path]
		if body == "" {
			t.Errorf("the node was asked %s %s", r.Method, r.URL.Path)
			http.NotFound(w, r)
			return
		}
		_, _ = io.WriteString(w, body+"\n")
	}))
	defer node.Close()
	c, err := client.New([]string{other.URL, node.URL}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	st, err := c.Status(ctx)
	if err != nil {
		t.Fatalf("status, another service listed first: %v", err)
	}
	if st.ID != "n1" || st.LeaderID != "" || st.Term != 0 {
		t.Errorf("status = id %q leader %q term %d, want the node's alone (n1, none, 0)", st.ID, st.LeaderID, st.Term)
	}
	for name, call := range readCalls(c) {
		if err := call(); err != nil {
			t.Errorf("%s, another service listed first: %v", name, err)
		}
	}
	if n := otherHits.Load(); n != 1 {
		t.Errorf("the other service was asked %d times, want once (the first call): it stayed preferred", n)
	}
}

// TestAReadThatFindsNoNodeNamesTheAnswerOfAnotherShape: when the endpoint
// that answered JSON of another shape is followed by one that does not
// answer, the error is still ErrNotAnAnswer naming the first (kvctl's hint
// that the address is not a node's API), with what the rest did.
func TestAReadThatFindsNoNodeNamesTheAnswerOfAnotherShape(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"foo":1}`+"\n")
	}))
	defer srv.Close()
	addr := srv.Listener.Addr().String()
	dead := deadAddr(t)
	c, err := client.New([]string{srv.URL, dead}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = c.IndexStats(context.Background())
	if !errors.Is(err, client.ErrNotAnAnswer) || !strings.Contains(err.Error(), addr) || !strings.Contains(err.Error(), dead) {
		t.Fatalf("index stats of [another service, nothing]: %v; want ErrNotAnAnswer naming %s, and %s", err, addr, dead)
	}
}

// TestReadyRefusesAnAnswerOfAnotherShape: a 200 from /readyz whose JSON
// holds nothing of a node's readiness answer ({"foo":1}, another service
// at that address) is ErrNotAnAnswer, as it is for every other read; it
// must not read as "a node that is not ready, applied index 0" (kvctl
// snapshot restore's probe took such an endpoint for a node). A 503 goes
// through the rule of every error answer: a node's (an error and reason
// not_ready, with or without the readiness fields: a node loading its
// state sends them alone) is a node that is not ready; any other 503 is
// an *Error, no answer of readiness. From the fuzzing review (e7fc329).
func TestReadyRefusesAnAnswerOfAnotherShape(t *testing.T) {
	var code atomic.Int64
	var body atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(int(code.Load()))
		_, _ = io.WriteString(w, body.Load().(string)+"\n")
	}))
	defer srv.Close()
	c, err := client.New([]string{srv.URL}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ask := func(status int, b string) (api.ReadyResponse, error) {
		code.Store(int64(status))
		body.Store(b)
		return c.Ready(context.Background())
	}
	if got, err := ask(http.StatusOK, `{"foo":1}`); !errors.Is(err, client.ErrNotAnAnswer) {
		t.Errorf("Ready of {\"foo\":1} answered %+v, %v; want ErrNotAnAnswer", got, err)
	}
	for _, b := range []string{
		`{"ready":false,"state":"Candidate","applied_index":4,"error":"not ready: Candidate at applied index 4","reason":"not_ready"}`,
		`{"error":"not ready: starting (loading its state)","reason":"not_ready"}`,
	} {
		if got, err := ask(http.StatusServiceUnavailable, b); err != nil || got.Ready || got.Reason != api.ReasonNotReady {
			t.Errorf("Ready of 503 %s answered %+v, %v; want a node that is not ready", b, got, err)
		}
	}
	var ae *client.Error
	if got, err := ask(http.StatusServiceUnavailable, `{"foo":1}`); !errors.As(err, &ae) || ae.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("Ready of 503 {\"foo\":1} answered %+v, %v; want a *client.Error of 503", got, err)
	}
}

// TestARestoreAnsweredWithAnotherBodyIsNoSuccess: a 200 to a restore whose
// body is not a restore's report (another service's JSON, a proxy's page,
// a list, an empty object) is an error that names the call, the status and
// the body's first bytes, ErrNotAnAnswer and ErrOutcomeUnknown (no node
// said it installed the snapshot; one behind a proxy may have). A JSON
// object was taken as a restore done, and kvctl printed "restored ...
// (index 0, term 0)". A node's report is read as before. From a review.
func TestARestoreAnsweredWithAnotherBodyIsNoSuccess(t *testing.T) {
	var body atomic.Value
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		_, _ = io.WriteString(w, body.Load().(string))
	}))
	defer srv.Close()
	c, err := client.New([]string{srv.URL}, client.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	restore := func() (raftfsm.SnapshotInfo, error) {
		return c.RestoreSnapshot(context.Background(), strings.NewReader("snapshot"))
	}
	long := "<html><body>" + strings.Repeat("x", 300) + "</body></html>"
	for _, b := range []string{`{"foo":1}` + "\n", "{}\n", "[]\n", `"ok"`, "<html>proxy ok</html>\n", long} {
		body.Store(b)
		info, err := restore()
		quoted := fmt.Sprintf("%q", b[:min(len(b), 20)])
		quoted = quoted[:len(quoted)-1] // the prefix's quote, left open
		if !errors.Is(err, client.ErrNotAnAnswer) || !errors.Is(err, client.ErrOutcomeUnknown) ||
			!strings.Contains(err.Error(), "POST /v1/snapshot/restore") || !strings.Contains(err.Error(), "HTTP 200") ||
			!strings.Contains(err.Error(), quoted) {
			t.Errorf("a restore answered 200 %q: %v, %+v; want ErrNotAnAnswer and ErrOutcomeUnknown naming the call, HTTP 200 and %s", b, err, info, quoted)
		}
		if err != nil && strings.Contains(err.Error(), strings.Repeat("x", 201)) {
			t.Errorf("a restore answered 200 with %d bytes: the error quotes more than its prefix: %v", len(b), err)
		}
	}
	body.Store(`{"format_version":4,"index":9,"term":2,"records":{},"bytes":8,"sha256":"ab"}` + "\n")
	if info, err := restore(); err != nil || info.Index != 9 || info.Term != 2 {
		t.Fatalf("a restore answered a node's report: %+v, %v; want index 9, term 2", info, err)
	}
}

// TestAWriteAnsweredByAnotherServiceIsNotDone: a node answers the writes
// that read no answer 204 No Content (a dump 200 with its report); another
// success (another service's 200 {"foo":1}) is client.ErrNotAnAnswer, and
// the write goes on to the next endpoint, as a read does, even one not
// safe twice (no node received it). From a review: each was taken for
// done, and kvctl printed "removed member n3" while n3 stayed a member.
func TestAWriteAnsweredByAnotherServiceIsNotDone(t *testing.T) {
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"foo":1}`+"\n")
	}))
	defer other.Close()
	ctx := context.Background()
	writes := func(c *client.Client) map[string]func() error {
		return map[string]func() error{
			"RegisterWorker":   func() error { return c.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 5, BlockSize: 4}) },
			"DeregisterWorker": func() error { return c.DeregisterWorker(ctx, 5) },
			"PrefillDone":      func() error { return c.PrefillDone(ctx, "r1") },
			"Free":             func() error { return c.Free(ctx, "r1") },
			"SetSettings":      func() error { return c.SetSettings(ctx, indexer.DefaultParams(), indexer.ViewDedup) },
			"AddMember":        func() error { return c.AddMember(ctx, "n4", "10.0.0.4:7946", "10.0.0.4:7080") },
			"RemoveMember":     func() error { return c.RemoveMember(ctx, "n3") },
			"TransferLeader":   func() error { return c.TransferLeader(ctx, "") },
			"DumpRank":         func() error { return c.DumpRank(ctx, kvevent.Rank{Worker: 5}, 1, nil) },
		}
	}
	for name, call := range writes(newClient(t, other.URL)) {
		if err := call(); !errors.Is(err, client.ErrNotAnAnswer) {
			t.Errorf("%s answered 200 {\"foo\":1}: %v, want ErrNotAnAnswer", name, err)
		}
	}

	// Listed before a node, the other service is passed over: the
	// registration and the removal (a write not safe twice) reach it.
	n := newNode(t, "n1")
	c := newClient(t, other.URL, n.srv.URL)
	if err := c.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 5, BlockSize: 4}); err != nil {
		t.Fatalf("RegisterWorker, another service listed first: %v", err)
	}
	if ws := n.fake.Workers(); len(ws) != 1 || ws[0].Info.ID != 5 {
		t.Fatalf("the node's workers after the registration: %+v, want worker 5", ws)
	}
	if err := c.DeregisterWorker(ctx, 5); err != nil {
		t.Fatalf("DeregisterWorker, another service listed first: %v", err)
	}
	if ws := n.fake.Workers(); len(ws) != 0 {
		t.Fatalf("the node's workers after the removal: %+v, want none", ws)
	}
}

// TestAWriteAnsweredWithAnyOther2xxIsNotDone: any success other than 204 to a write a node answers
// 204 is no node's answer, not only 200 (another REST service answers a
// POST 201 Created, or 202 Accepted, with no body).
func TestAWriteAnsweredWithAnyOther2xxIsNotDone(t *testing.T) {
	for _, code := range []int{http.StatusOK, http.StatusCreated, http.StatusAccepted, http.StatusResetContent} {
		other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.WriteHeader(code)
		}))
		c := newClient(t, other.URL)
		ctx := context.Background()
		for name, call := range map[string]func() error{
			"RegisterWorker": func() error { return c.RegisterWorker(ctx, raftfsm.WorkerInfo{ID: 5, BlockSize: 4}) },
			"RemoveMember":   func() error { return c.RemoveMember(ctx, "n3") },
		} {
			if err := call(); !errors.Is(err, client.ErrNotAnAnswer) {
				t.Errorf("%s answered HTTP %d, no body: %v, want ErrNotAnAnswer", name, code, err)
			}
		}
		other.Close()
	}
}
