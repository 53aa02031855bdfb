package api

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"net/http"
	rtmetrics "runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/prometheus/client_golang/prometheus"
)

// routeScratch is a route request's working memory, pooled: the decoded
// request and its arrays (which the backend does not keep past Route, see
// Backend), and the answer's bytes.
type routeScratch struct {
	req RouteRequest
	out []byte
}

var routeScratchPool = sync.Pool{New: func() any { return new(routeScratch) }}

// maxPooledRoute bounds the array lengths a pooled routeScratch keeps.
const maxPooledRoute = 1 << 16

func (s *Server) route(w http.ResponseWriter, r *http.Request) error {
	sc := routeScratchPool.Get().(*routeScratch)
	defer func() {
		sc.req = RouteRequest{BlockHashes: sc.req.BlockHashes[:0], TokenIDs: sc.req.TokenIDs[:0]}
		if cap(sc.req.BlockHashes) > maxPooledRoute {
			sc.req.BlockHashes = nil
		}
		if cap(sc.req.TokenIDs) > maxPooledRoute {
			sc.req.TokenIDs = nil
		}
		if cap(sc.out) > maxPooledRoute {
			sc.out = nil
		}
		routeScratchPool.Put(sc)
	}()
	req := &sc.req
	decodeStart := time.Now()
	if err := decodeRouteRequest(r, req); err != nil {
		s.m.forModel("").error.Inc()
		return err
	}
	q, err := routeQuery(req)
	if err != nil {
		// Not forModel: a refused request's model name is anything a
		// client wrote, and must not use up the labels valid ones get.
		s.m.knownModel(req.Model).error.Inc()
		return err
	}
	counts := s.m.forModel(req.Model)
	start := time.Now()
	res, err := s.b.Route(r.Context(), q)
	if errors.Is(err, raftfsm.ErrNotLeader) {
		// A booking for the leader: decided, timed and counted there
		// when the forward is sent, as an error here when this node
		// answers it (fail). Not timed here: its decode is the leader's
		// to time again, and the backend's time to say it does not lead
		// is no decision's.
		return &leaderRoute{error: err, answered: counts.error}
	}
	s.m.stageDecode.Observe(start.Sub(decodeStart).Seconds())
	s.m.stageBackend.Observe(time.Since(start).Seconds())
	if err != nil {
		switch {
		case errors.Is(err, indexer.ErrOverloaded):
			s.m.stages(&res.Stages)
			counts.busy.Inc()
			// Brief answers without candidates, busy or not: a hot path
			// that meets every rank busy needs the reason, not the scores.
			if len(res.Decision.Candidates) > 0 && !req.Brief {
				cands, left := candidates(&res.Decision)
				err = &withCandidates{error: err, cands: cands, leftOut: left}
			}
		case errors.Is(err, indexer.ErrNoWorkers):
			counts.noWorkers.Inc()
		default:
			counts.error.Inc()
		}
		return err
	}
	s.m.stages(&res.Stages)
	counts.routed.Inc()
	s.m.routed(&res.Decision, res.BlockSize)
	if req.Brief {
		// The router's hot path: encoded by hand, byte for byte what
		// encoding/json gives (TestBriefRouteResponseMatchesEncodingJSON).
		if b, ok := appendBriefRouteResponse(sc.out[:0], &res); ok {
			sc.out = b
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusOK)
			_, _ = w.Write(append(b, '\n'))
			return nil
		}
	}
	return reply(w, http.StatusOK, routeResponse(&res, req.Brief))
}

// leaderRoute is a route the backend left to the leader (ErrNotLeader).
// The leader counts it when the forward is sent; when this node answers it
// itself (the forward failed, or was refused: a loop, a body too large to
// replay), fail counts it answered, so that every route answered is
// counted by the node that answered it.
type leaderRoute struct {
	error
	answered prometheus.Counter
}

func (e *leaderRoute) Unwrap() error { return e.error }

func (s *Server) prefillDone(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	if err := checkID("request id", id); err != nil {
		return err
	}
	if err := s.b.PrefillDone(r.Context(), id); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) free(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	if err := checkID("request id", id); err != nil {
		return err
	}
	if err := s.b.Free(r.Context(), id); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) workers(w http.ResponseWriter, _ *http.Request) error {
	return reply(w, http.StatusOK, workers(s.b.Workers()))
}

func (s *Server) registerWorker(w http.ResponseWriter, r *http.Request) error {
	var req RegisterWorkerRequest
	if err := decodeJSONWithin(r, &req, false, &registerCosts); err != nil {
		return err
	}
	info, err := workerInfo(&req)
	if err != nil {
		return err
	}
	// Under the backend's worker-table lock, which the compatible APIs'
	// read-modify-writes of the table take too: the checks judge the table
	// the registration is written into.
	unlock := raftfsm.LockWorkers(s.b)
	err = s.checkWorker(info)
	if err == nil {
		err = s.b.RegisterWorker(r.Context(), info)
	}
	unlock()
	if err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) deregisterWorker(w http.ResponseWriter, r *http.Request) error {
	id, err := parseUint("worker id", r.PathValue("id"), 64)
	if err != nil {
		return err
	}
	unlock := raftfsm.LockWorkers(s.b)
	err = s.b.DeregisterWorker(r.Context(), id)
	unlock()
	if err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) indexStats(w http.ResponseWriter, _ *http.Request) error {
	st := indexStats(s.b.IndexStats())
	m := []rtmetrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	rtmetrics.Read(m)
	if m[0].Value.Kind() == rtmetrics.KindUint64 {
		st.HeapBytes = m[0].Value.Uint64()
	}
	return reply(w, http.StatusOK, st)
}

// getSettings answers the settings this node's state holds, in the shape
// of PUT /v1/settings' body (every field given). With ?consistent=true it
// answers only on a leader whose state holds every entry committed before
// its term (Backend.CheckLeader): a follower forwards the read to the
// leader as it does a write, and a leader just elected, before its
// post-election Barrier, answers 503 no_leader. A read-modify-write
// (kvctl settings set) reads so, or it would put back a state that lacks
// a change the previous leader acknowledged, undoing it for good.
func (s *Server) getSettings(w http.ResponseWriter, r *http.Request) error {
	consistent, err := parseConsistent(r)
	if err != nil {
		return err
	}
	if consistent {
		if err := s.b.CheckLeader(); err != nil {
			return err
		}
	}
	st := s.b.Settings()
	return reply(w, http.StatusOK, SettingsRequest{Params: &st.Params, View: st.View.String()})
}

// parseConsistent reads a read's consistent query parameter: absent,
// "false" or "true" (strconv.ParseBool's other spellings too).
func parseConsistent(r *http.Request) (bool, error) {
	v, ok := r.URL.Query()["consistent"]
	if !ok {
		return false, nil
	}
	if len(v) != 1 {
		return false, invalidf("consistent is given %d times, want once", len(v))
	}
	b, err := strconv.ParseBool(v[0])
	if err != nil {
		return false, invalidf("consistent %q is not a boolean (true, false, 1, 0, ...)", v[0])
	}
	return b, nil
}

func (s *Server) setSettings(w http.ResponseWriter, r *http.Request) error {
	// Decoding into the defaults leaves the fields the client left out at
	// their default values.
	defaults := indexer.DefaultParams()
	req := SettingsRequest{Params: &defaults}
	if err := decodeJSON(r, &req, false); err != nil {
		return err
	}
	st, err := settings(&req, s.b.Settings().Params)
	if err != nil {
		return err
	}
	if err := s.b.SetSettings(r.Context(), st); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) events(w http.ResponseWriter, r *http.Request) error {
	var req EventsRequest
	if err := decodeJSONWithin(r, &req, false, &eventsCosts); err != nil {
		return err
	}
	batches, err := rankBatches(&req)
	if err != nil {
		return err
	}
	acks, err := s.b.IngestEvents(r.Context(), batches)
	if err != nil {
		return err
	}
	if len(acks) != len(batches) {
		return fmt.Errorf("the node acknowledged %d batches of %d", len(acks), len(batches))
	}
	out := EventsResponse{Acks: make([]Ack, len(acks))}
	for i, a := range acks {
		// The rank comes from the batch: an ack answers its batch by position.
		rank := batches[i].Rank
		out.Acks[i] = Ack{WorkerID: rank.Worker, DPRank: rank.DP,
			Cursor: a.Cursor, Applied: a.Applied, Dups: a.Dups, Gap: a.Gap, Resync: a.Resync}
		if a.Gap {
			s.m.eventGaps.Inc()
		}
	}
	return reply(w, http.StatusOK, out)
}

func (s *Server) dump(w http.ResponseWriter, r *http.Request) error {
	worker, err := parseUint("worker id", r.PathValue("worker"), 64)
	if err != nil {
		return err
	}
	dp, err := parseUint("dp rank", r.PathValue("dp"), 32)
	if err != nil {
		return err
	}
	rank := kvevent.Rank{Worker: worker, DP: uint32(dp)}
	var req DumpRequest
	if err := decodeJSONWithin(r, &req, false, &dumpCosts); err != nil {
		return err
	}
	stored, err := dumpEvents(rank, &req)
	if err != nil {
		return err
	}
	if err := s.b.ReplaceRank(r.Context(), rank, req.Cursor, stored); err != nil {
		return err
	}
	return reply(w, http.StatusOK, DumpResponse{WorkerID: worker, DPRank: uint32(dp), Cursor: req.Cursor, Events: len(stored)})
}

func (s *Server) status(w http.ResponseWriter, _ *http.Request) error {
	st := s.b.Status()
	if n := s.natsState(); n != "" {
		st.NATS = n
	}
	return reply(w, http.StatusOK, st)
}

// natsState is the node's NATS connection as /readyz and
// /v1/cluster/status show it: "connected", "disconnected", or "" where
// the server was given no NATSConnected.
func (s *Server) natsState() string {
	switch {
	case s.opts.NATSConnected == nil:
		return ""
	case s.opts.NATSConnected():
		return "connected"
	}
	return "disconnected"
}

func (s *Server) members(w http.ResponseWriter, r *http.Request) error {
	ms, err := s.b.Members(r.Context())
	if err != nil {
		return err
	}
	ms = slices.Clone(ms)
	slices.SortFunc(ms, func(a, b raftfsm.Member) int { return cmp.Compare(a.ID, b.ID) })
	if ms == nil {
		ms = []raftfsm.Member{}
	}
	return reply(w, http.StatusOK, MembersResponse{Members: ms})
}

func (s *Server) addMember(w http.ResponseWriter, r *http.Request) error {
	var req AddMemberRequest
	if err := decodeJSON(r, &req, false); err != nil {
		return err
	}
	if err := checkID("id", req.ID); err != nil {
		return err
	}
	if err := checkAddr("raft_addr", req.RaftAddr); err != nil {
		return err
	}
	// As kvrouter checks its --raft-addr: a wildcard host reaches whatever
	// listens on that port on the leader's host, the leader itself first.
	if err := raftfsm.CheckRaftAddr(req.RaftAddr); err != nil {
		return invalidf("raft_addr %v", err)
	}
	if err := checkAddr("http_addr", req.HTTPAddr); err != nil {
		return err
	}
	// Followers forward writes to the leader's http_addr: a wildcard
	// reaches the forwarding node itself (kvrouter --http-advertise).
	if err := raftfsm.CheckHTTPAddr(req.HTTPAddr); err != nil {
		return invalidf("http_addr %v", err)
	}
	if err := s.b.AddMember(r.Context(), req.ID, req.RaftAddr, req.HTTPAddr); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) removeMember(w http.ResponseWriter, r *http.Request) error {
	id := r.PathValue("id")
	if err := checkID("member id", id); err != nil {
		return err
	}
	if err := s.b.RemoveMember(r.Context(), id); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) transferLeader(w http.ResponseWriter, r *http.Request) error {
	var req TransferLeaderRequest
	if err := decodeJSON(r, &req, true); err != nil {
		return err
	}
	if req.To != "" {
		if err := checkID("to", req.To); err != nil {
			return err
		}
	}
	if err := s.b.TransferLeadership(r.Context(), req.To); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

var snapshotTrailers = strings.Join([]string{
	TrailerSnapshotIndex, TrailerSnapshotTerm, TrailerSnapshotSHA256, TrailerSnapshotBytes,
	TrailerSnapshotVersion, TrailerError, TrailerErrorReason,
}, ", ")

// saveSnapshot streams the backend's snapshot. What describes it (index,
// term, checksum) is known only once it is written, so it goes in HTTP
// trailers; a failure after the first byte goes in the error trailers,
// and the client must throw the stream away.
func (s *Server) saveSnapshot(w http.ResponseWriter, r *http.Request) error {
	h := w.Header()
	h.Set("Content-Type", "application/octet-stream")
	if r.Method == http.MethodHead {
		// The headers alone: a snapshot reads the whole state, and a HEAD's
		// would be thrown away. Nothing describes it before it is written
		// (the trailers), so no other header is sent.
		w.WriteHeader(http.StatusOK)
		return nil
	}
	h.Set("Trailer", snapshotTrailers)
	cw := &countingWriter{w: w}
	info, err := s.b.SaveSnapshot(r.Context(), cw)
	if err != nil {
		if cw.n == 0 {
			// Nothing sent yet: answer (or forward) like any other error.
			h.Del("Trailer")
			h.Del("Content-Type")
			return err
		}
		_, reason := classify(err)
		h.Set(TrailerError, oneLine(err.Error()))
		h.Set(TrailerErrorReason, reason)
		return err
	}
	if cw.n == 0 {
		w.WriteHeader(http.StatusOK)
	}
	h.Set(TrailerSnapshotIndex, strconv.FormatUint(info.Index, 10))
	h.Set(TrailerSnapshotTerm, strconv.FormatUint(info.Term, 10))
	h.Set(TrailerSnapshotVersion, strconv.FormatUint(uint64(info.FormatVersion), 10))
	h.Set(TrailerSnapshotBytes, strconv.FormatInt(cmp.Or(info.Bytes, cw.n), 10))
	if info.SHA256 != "" {
		h.Set(TrailerSnapshotSHA256, info.SHA256)
	}
	return nil
}

func (s *Server) restoreSnapshot(w http.ResponseWriter, r *http.Request) error {
	upload := &uploadBody{r: r.Body}
	info, err := s.b.RestoreSnapshot(r.Context(), upload)
	if err != nil {
		if readErr := upload.readErr(); readErr != nil {
			// The upload could not be read whole: the client's fault (or
			// its connection's), whatever the backend made of it (a node
			// reports a read error of its spool as its own failure).
			return uploadError(readErr)
		}
		return err
	}
	return reply(w, http.StatusOK, info)
}

// uploadBody is a request body that keeps the first error reading it gave
// (io.EOF aside). It may be read in another goroutine than the one that
// asks (a forward's transport).
type uploadBody struct {
	r   io.Reader
	err atomic.Pointer[error]
}

func (u *uploadBody) Read(p []byte) (int, error) {
	n, err := u.r.Read(p)
	if err != nil && err != io.EOF {
		u.err.CompareAndSwap(nil, &err)
	}
	return n, err
}

// readErr is the first error reading the body gave; nil: none.
func (u *uploadBody) readErr() error {
	if e := u.err.Load(); e != nil {
		return *e
	}
	return nil
}

// uploadError answers a snapshot upload that could not be read whole
// (readErr is what reading it returned); nothing was installed. Over the
// size limit is 413 too_large; cut off before the length it promised is a
// truncated snapshot, 400 bad_snapshot, as a node says of a stream cut
// short (docs/api.md); otherwise as BodyReadError says, a malformed
// framing being 400 bad_snapshot: sent again, it fails again.
func uploadError(readErr error) error {
	var mbe *http.MaxBytesError
	if errors.As(readErr, &mbe) {
		return fmt.Errorf("restore: nothing was installed: receive snapshot: %w", readErr)
	}
	if errors.Is(readErr, io.ErrUnexpectedEOF) {
		return &httpError{code: http.StatusBadRequest, reason: ReasonBadSnapshot,
			err: errors.New("restore: nothing was installed: the upload was cut off before its end")}
	}
	code, msg := BodyReadError(readErr)
	reason := ReasonBadSnapshot
	switch code {
	case http.StatusRequestTimeout:
		reason = ReasonRequestTimeout
	case http.StatusServiceUnavailable:
		reason = ReasonCanceled
	}
	return &httpError{code: code, reason: reason, err: fmt.Errorf("restore: nothing was installed: %w", msg)}
}

func (s *Server) healthz(w http.ResponseWriter, _ *http.Request) error {
	return reply(w, http.StatusOK, map[string]string{"status": "ok"})
}

func (s *Server) readyz(w http.ResponseWriter, _ *http.Request) error {
	st := s.b.Readiness()
	resp := ReadyResponse{Ready: st.Ready, State: st.State, AppliedIndex: st.AppliedIndex, NATS: s.natsState()}
	if st.Ready {
		return reply(w, http.StatusOK, resp)
	}
	resp.Reason = ReasonNotReady
	resp.Error = fmt.Sprintf("not ready: %s at applied index %d", cmp.Or(st.State, "starting"), st.AppliedIndex)
	switch {
	case st.ApplyHalted != "":
		resp.Error += ", " + st.ApplyHalted + " (docs/operations.md, Upgrade)"
	case st.Removed:
		resp.Error += ", removed from the cluster: stop this node (docs/operations.md, Remove a node)"
	case st.LeaderID == "" && st.State != "":
		resp.Error += ", no leader known"
	}
	return reply(w, http.StatusServiceUnavailable, resp)
}

type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// oneLine makes s fit a header value.
func oneLine(s string) string {
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, s)
}
