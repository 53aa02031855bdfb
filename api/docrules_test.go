package api_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/api/apitest"
	"github.com/kvrouter/kvrouter/internal/limits"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
)

// serveBackend runs an API server over b on a real listener and returns
// its URL, for a test whose backend answers what the fake alone does not.
func serveBackend(t *testing.T, b api.Backend) string {
	t.Helper()
	reg := prometheus.NewRegistry()
	s := api.NewServer(b, api.Options{Logger: slog.New(slog.DiscardHandler), Registerer: reg, Gatherer: reg})
	hs := httptest.NewServer(s)
	t.Cleanup(func() {
		hs.Close()
		s.Close()
	})
	return hs.URL
}

// resyncAcks is a backend whose acks say resync for dp rank 1 alone (the
// fake never loses events, so never says it).
type resyncAcks struct{ *apitest.Fake }

func (b resyncAcks) IngestEvents(ctx context.Context, batches []raftfsm.RankBatch) ([]raftfsm.RankAck, error) {
	acks, err := b.Fake.IngestEvents(ctx, batches)
	for i := range acks {
		acks[i].Resync = acks[i].Rank.DP == 1
	}
	return acks, err
}

// TestEventsAckCarriesResyncOnlyWhenSet: an ack of POST /v1/events says
// "resync": true for a rank whose ack from the backend says resync, and
// leaves the key out for one whose does not (docs/api.md: "`resync:
// true` (left out when false) means the rank lost events ... dump the
// rank"). From a review: dropping Resync from the ack passed every test.
func TestEventsAckCarriesResyncOnlyWhenSet(t *testing.T) {
	url := serveBackend(t, resyncAcks{apitest.New("n1", "")})
	body := `{"batches":[{"worker_id":1,"dp_rank":0,"events":[` + storedEv + `]},` +
		`{"worker_id":1,"dp_rank":1,"events":[` + storedEv + `]}]}`
	a := send(t, url, "POST", "/v1/events", body)
	if a.code != http.StatusOK {
		t.Fatalf("POST /v1/events: %d %s", a.code, a.body)
	}
	acks, _ := a.json(t)["acks"].([]any)
	if len(acks) != 2 {
		t.Fatalf("acks = %s, want two", a.body)
	}
	if ack := acks[0].(map[string]any); ack["dp_rank"] != 0.0 || slices.Contains(keysOf(ack), "resync") {
		t.Errorf("the ack of a rank not in resync = %v, want no resync key", ack)
	}
	if ack := acks[1].(map[string]any); ack["dp_rank"] != 1.0 || ack["resync"] != true {
		t.Errorf("the ack of a rank in resync = %v, want \"resync\": true", ack)
	}
}

// heardAt is a backend whose ranks' events last reached the log at a
// known instant, lastHeard unix nanoseconds (the fake's never did).
type heardAt struct {
	*apitest.Fake
	lastHeard int64
}

func (b heardAt) Workers() []raftfsm.WorkerStatus {
	ws := b.Fake.Workers()
	for i := range ws {
		for j := range ws[i].Ranks {
			ws[i].Ranks[j].LastHeard = b.lastHeard
		}
	}
	return ws
}

// TestLastHeardIsInUnixMilliseconds: GET /v1/workers shows a rank's
// last_heard_ms in unix milliseconds of the leader's clock (docs/api.md),
// the backend's unix nanoseconds divided by a million. From a review:
// passing the nanoseconds through passed every test.
func TestLastHeardIsInUnixMilliseconds(t *testing.T) {
	f := apitest.New("n1", "")
	if err := f.RegisterWorker(context.Background(), raftfsm.WorkerInfo{ID: 1, BlockSize: 4}); err != nil {
		t.Fatal(err)
	}
	const nanos, ms = 1764621000123456789, 1764621000123
	a := send(t, serveBackend(t, heardAt{Fake: f, lastHeard: nanos}), "GET", "/v1/workers", "")
	var resp api.WorkersResponse
	if err := json.Unmarshal(a.body, &resp); err != nil || a.code != http.StatusOK {
		t.Fatalf("GET /v1/workers: %d %s (%v)", a.code, a.body, err)
	}
	if len(resp.Workers) != 1 || len(resp.Workers[0].Ranks) != 1 {
		t.Fatalf("workers = %s, want one of one rank", a.body)
	}
	if got := resp.Workers[0].Ranks[0].LastHeardMs; got != ms {
		t.Fatalf("last_heard_ms of a rank last heard at %d unix ns = %d, want %d", int64(nanos), got, int64(ms))
	}
}

// TestReadyzSaysWhenNoLeaderIsKnown: /readyz of a node that is not ready
// and knows no leader says `no leader known` (docs/api.md), and one that
// knows its leader does not. From a review: the branch made unreachable
// passed every test.
func TestReadyzSaysWhenNoLeaderIsKnown(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	for _, c := range []struct {
		leader string
		want   bool
	}{{"", true}, {"n9", false}} {
		n.fake.SetFollower(c.leader, "")
		n.fake.SetReady(false)
		a := send(t, n.http.URL, "GET", "/readyz", "")
		msg := fmt.Sprint(a.json(t)["error"])
		if a.code != http.StatusServiceUnavailable || a.reason(t) != api.ReasonNotReady || strings.Contains(msg, "no leader known") != c.want {
			t.Errorf("/readyz of a follower not ready with leader %q: %d %s, want 503 not_ready that says \"no leader known\" %v",
				c.leader, a.code, a.body, c.want)
		}
	}
}

// TestRestoreUploadCutOffIsBadSnapshot: a snapshot upload whose connection
// ends before its Content-Length is a truncated snapshot, 400
// bad_snapshot (docs/api.md), naming no address, and nothing is
// installed; not 503 canceled, which a JSON body cut off is. From a
// review: answering it 503 canceled passed every test.
func TestRestoreUploadCutOffIsBadSnapshot(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	req := "POST /v1/snapshot/restore HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\nContent-Length: 100\r\n\r\nKVRSN"
	code, reason, msg := sendRawRequest(t, n, "/v1/snapshot/restore", req, true)
	if code != http.StatusBadRequest || reason != api.ReasonBadSnapshot || !strings.Contains(msg, "cut off") || strings.Contains(msg, "127.0.0.1") {
		t.Errorf("a restore upload cut off before its Content-Length: %d %s %q, want 400 bad_snapshot saying it was cut off, naming no address", code, reason, msg)
	}
	if n.fake.Restores() != 0 {
		t.Fatal("a cut-off upload was installed")
	}
}

// TestUnbookedRouteRequestIDIsChecked: a route's request_id is held to
// "at most 256 bytes, no control characters" (docs/api.md) when the route
// books nothing too: 400 invalid naming request_id, and the backend never
// asked. From a review: checking it only with book passed every test.
func TestUnbookedRouteRequestIDIsChecked(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	for name, id := range map[string]string{
		"too long":          strings.Repeat("r", limits.MaxIDLen+1),
		"control character": `r\u00011`,
		"line break":        `r\n1`,
	} {
		a := send(t, n.http.URL, "POST", "/v1/route", `{"isl":5,"request_id":"`+id+`"}`)
		if a.code != http.StatusBadRequest || a.reason(t) != api.ReasonInvalid || !strings.Contains(string(a.body), "request_id") {
			t.Errorf("an unbooked route with a request_id %s: %d %.200s, want 400 invalid naming request_id", name, a.code, a.body)
		}
	}
	if got := n.fake.Calls()["Route"]; got != 0 {
		t.Fatalf("the backend routed %d refused requests", got)
	}
	// The longest allowed goes through.
	a := send(t, n.http.URL, "POST", "/v1/route", `{"isl":5,"request_id":"`+strings.Repeat("r", limits.MaxIDLen)+`"}`)
	if a.code != http.StatusOK {
		t.Fatalf("an unbooked route with a request_id of %d bytes: %d %s, want 200", limits.MaxIDLen, a.code, a.body)
	}
}

// TestBodyNotAnObjectSaysWhatItStartsWith: a JSON body that does not start
// with '{' is 400 bad_json, and the message says what it starts with in
// words an operator reads: a UTF-8 byte-order mark by that name, any
// other byte that is not printable ASCII as a hex byte, a printable one
// quoted. From a review: a body behind a byte-order mark was refused with
// "the body starts with 'ï'", its first byte shown as a Latin-1 letter.
func TestBodyNotAnObjectSaysWhatItStartsWith(t *testing.T) {
	n := newNode(t, "n1", api.Options{})
	withWorkers(t, n)
	for _, c := range []struct{ body, want string }{
		{"\xef\xbb\xbf{\"worker_id\":7,\"block_size\":4}", "the body starts with a UTF-8 byte-order mark (want a JSON object)"},
		{"\xef\xbb{\"worker_id\":7,\"block_size\":4}", "the body starts with the byte 0xef (want a JSON object)"},
		{"\xc3\xa9", "the body starts with the byte 0xc3 (want a JSON object)"},
		{"\x01{}", "the body starts with the byte 0x01 (want a JSON object)"},
		{" [1]", "the body starts with '[' (want a JSON object)"},
	} {
		for _, path := range []string{"/v1/workers", "/v1/route"} {
			a := send(t, n.http.URL, "POST", path, c.body)
			if a.code != http.StatusBadRequest || a.reason(t) != api.ReasonBadJSON || a.json(t)["error"] != c.want {
				t.Errorf("POST %s of %q: %d %s, want 400 bad_json %q", path, c.body, a.code, a.body, c.want)
			}
		}
	}
}

// TestReferencePageCoversEveryRoute keeps docs/api.md and the routes the
// Server registers (routes) in step: each route has its section, a
// heading "### `METHOD /path`" with the pattern as registered, and each
// such heading names a route the Server has. A fresh Server's
// kvrouter_http_request_duration_seconds has a series for every pattern
// it registered (present from the start), so the routes are read there,
// not from the source.
func TestReferencePageCoversEveryRoute(t *testing.T) {
	const page = "../docs/api.md"
	data, err := os.ReadFile(page)
	if err != nil {
		t.Fatalf("read the reference page: %v", err)
	}
	var documented []string
	for line := range strings.SplitSeq(string(data), "\n") {
		if h, ok := strings.CutPrefix(line, "### `"); ok {
			if p, _, ok := strings.Cut(h, "`"); ok && strings.Contains(p, " /") {
				documented = append(documented, p)
			}
		}
	}

	reg := prometheus.NewRegistry()
	s := api.NewServer(apitest.New("n1", ""), api.Options{Logger: slog.New(slog.DiscardHandler), Registerer: reg, Gatherer: reg})
	defer s.Close()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var routes []string
	for _, f := range families {
		if f.GetName() != "kvrouter_http_request_duration_seconds" {
			continue
		}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "route" {
					routes = append(routes, l.GetValue())
				}
			}
		}
	}
	if len(routes) < 10 {
		t.Fatalf("a fresh server's request durations have %d route series: %v; want one per route it registers", len(routes), routes)
	}
	for _, r := range routes {
		if !slices.Contains(documented, r) {
			t.Errorf("route %q has no section in %s (a heading ### `%s`)", r, page, r)
		}
	}
	for _, d := range documented {
		if !slices.Contains(routes, d) {
			t.Errorf("%s documents %q, which the server does not route", page, d)
		}
	}
}
