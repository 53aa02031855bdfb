package engineapi

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/internal/httpbody"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/offload/backend"
	"github.com/kvrouter/kvrouter/offload/manager"
	"github.com/kvrouter/kvrouter/offload/pool"
)

// RankPools are the pools of one dp rank: a G2 host pool, a G3 disk pool,
// or both. They stay the caller's: close them after the Server.
type RankPools struct {
	Rank kvevent.Rank
	Host *pool.HostPool
	Disk *pool.DiskPool
}

// Config configures a Server.
type Config struct {
	// Socket is the path of the Unix socket to listen on. A stale socket
	// file (no process answers on it) is removed; any other file there is
	// an error. The socket is made 0600: only the agent's user (and root)
	// may connect.
	Socket string
	// Backend copies the blocks; the pools must be made from it.
	Backend backend.Backend
	// Ranks lists the dp ranks served, with their pools; every pool must
	// hold blocks of the same size.
	Ranks []RankPools
	// Checker, when set, checks every block of an offload request against
	// what the engine reported before any of it is queued: a block it
	// refuses makes the whole request a bad_request. kvagent sets its agent.
	Checker Checker
	// Manager is the template of each rank's Manager: QueueCapacity,
	// Workers, BatchSize, Filter and OnboardTimeout are used; Rank,
	// Backend, G1, Host, Disk, Registerer and Logger are set per rank.
	Manager manager.Config
	// SettleTimeout bounds how long an onboard answer waits, past the
	// onboard's deadline, for copies into G1 that were already running
	// (see OnboardResponse.Settled); default 5s.
	SettleTimeout time.Duration
	// MaxBodyBytes bounds a request body; default 16 MiB.
	MaxBodyBytes int64
	// MaxRegionBlocks bounds a registration's num_blocks; default
	// DefaultMaxRegionBlocks. The agent keeps state per G1 block (a few
	// dozen bytes each), and a request of a hundred bytes names the
	// count: with the host backend, a sparse file of any size passes the
	// mapping's length check. A larger region is refused (bad_request)
	// before anything is sized by it.
	MaxRegionBlocks int
	// Registerer, when set, gets the server's metrics
	// (kvagent_engineapi_*) and the Managers' (kvagent_offload_*).
	Registerer prometheus.Registerer
	// Logger; nil is slog.Default().
	Logger *slog.Logger
}

// A Checker checks a block an engine asks to offload: parent is its
// parent's hash (0 for the first block of a sequence), b its engine and
// content hashes. An error refuses it. *agent.Agent is one: it refuses a
// block that contradicts the engine's own events.
type Checker interface {
	CheckOffload(r kvevent.Rank, parent uint64, b kvevent.Block) error
}

// DefaultMaxRegionBlocks is Config.MaxRegionBlocks when it is 0: 1 Mi G1
// blocks, 24 MiB of the agent's state per rank (measured: 24 bytes a block).
const DefaultMaxRegionBlocks = 1 << 20

const (
	defaultSettleTimeout = 5 * time.Second
	defaultMaxBody       = 16 << 20
)

// bodyTimeout is how long a request's body has to arrive once its header
// has (docs/api.md's 30 s for kvrouter's ports); a variable so that a
// test can shorten it.
var bodyTimeout = 30 * time.Second

// shutdownGrace is how long Close lets connections with a request in flight
// finish before it cuts them; a variable so that a test can shorten it.
var shutdownGrace = 10 * time.Second

// Test hooks, nil outside tests: testHookHandler runs as a handler starts
// (once it counts as in flight), testHookCloseWait when Close starts
// waiting for the handlers still running, testHookFreed when an
// attachment's shutdown has freed its blocks and is about to close its
// Manager.
var (
	testHookHandler   func(path string)
	testHookCloseWait func()
	testHookFreed     func()
)

// Server is the engine-facing offload API on a Unix socket. See the
// package documentation for what it guarantees.
type Server struct {
	cfg     Config
	be      backend.Backend
	log     *slog.Logger
	ln      net.Listener
	hs      *http.Server
	served  chan struct{} // closed when hs.Serve returned
	ranks   map[uint32]*rankSlot
	order   []*rankSlot // by dp rank
	metrics *serverMetrics

	hmu      sync.Mutex     // guards hclosed and the Adds to handlers
	hclosed  bool           // Close began: handlers are refused
	handlers sync.WaitGroup // handlers running

	closeOnce sync.Once
	closeErr  error
}

// A rankSlot is one dp rank: its pools and, once the engine registered its
// region, the attachment (mapping + Manager) requests use.
type rankSlot struct {
	rank      kvevent.Rank
	host      *pool.HostPool
	disk      *pool.DiskPool
	blockSize int
	paths     []manager.Path       // the paths its pools allow, for stats
	idle      prometheus.Collector // its Manager's families at zero, while it has none

	regMu sync.Mutex // serialises registrations (and Close) of the rank

	mu     sync.Mutex // guards closed and cur
	closed bool
	cur    *attachment
}

// An attachment is a registered region and the Manager running on it.
// Requests hold a reference (users) while they use it; shutdown waits for
// them before it unmaps the region.
type attachment struct {
	m      *manager.Manager
	mp     *manager.Mapping
	handle backend.IPCHandle
	layout manager.Layout

	users sync.WaitGroup // requests using m; Add only while attached (under rankSlot.mu)
	once  sync.Once
	err   error
}

// freeChunk is how many G1 blocks shutdown frees in one Manager.Free.
const freeChunk = 4096

// shutdown ends an attachment that is no longer reachable from its slot:
// it makes the Manager refuse new offloads and onboards, frees every G1
// block (a copy still running is discarded, no STORE follows), closes the
// Manager (copies in flight finish, queued work is dropped, waiting
// onboards return), waits for the requests still using it, and unmaps the
// region. A second call waits for the first.
func (a *attachment) shutdown() error {
	a.once.Do(func() {
		// Refuse first: a request that took its reference before the
		// slot let go of the attachment may reach the Manager after the
		// Free below, and would queue a copy of a block already counted
		// as freed (a STORE of the old region) or an onboard into one.
		a.m.Refuse()
		// In chunks: one slice of every id would be 8 bytes a block again,
		// on top of the Manager's state.
		var errs []error
		ids := make([]int, 0, min(a.layout.Blocks, freeChunk))
		for from := 0; from < a.layout.Blocks; from += freeChunk {
			ids = ids[:0]
			for id := from; id < min(from+freeChunk, a.layout.Blocks); id++ {
				ids = append(ids, id)
			}
			errs = append(errs, a.m.Free(ids...))
		}
		if testHookFreed != nil {
			testHookFreed()
		}
		errs = append(errs, a.m.Close())
		a.users.Wait()
		errs = append(errs, a.mp.Close())
		a.err = errors.Join(errs...)
	})
	return a.err
}

// Listen checks cfg, listens on cfg.Socket and serves until Close.
func Listen(cfg Config) (*Server, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.SettleTimeout <= 0 {
		cfg.SettleTimeout = defaultSettleTimeout
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = defaultMaxBody
	}
	if cfg.MaxRegionBlocks <= 0 {
		cfg.MaxRegionBlocks = DefaultMaxRegionBlocks
	}
	s := &Server{cfg: cfg, be: cfg.Backend, log: cfg.Logger.With("component", "offload.engineapi"),
		served: make(chan struct{}), ranks: map[uint32]*rankSlot{}}
	if err := s.addRanks(); err != nil {
		return nil, fmt.Errorf("engine API: %w", err)
	}
	m := cfg.Manager
	if m.QueueCapacity < 0 || m.Workers < 0 || m.BatchSize < 0 || m.OnboardTimeout < 0 ||
		m.Filter.Threshold < 0 || m.Filter.HalfLife < 0 {
		return nil, fmt.Errorf("engine API: manager settings %+v: negative values", m)
	}
	if err := m.Filter.Check(); err != nil {
		// Refused now, not at the first registration.
		return nil, fmt.Errorf("engine API: manager settings: %w", err)
	}
	var err error
	if s.metrics, err = newServerMetrics(cfg.Registerer, s.order); err != nil {
		return nil, fmt.Errorf("engine API: %w", err)
	}
	if s.ln, err = listenUnix(cfg.Socket); err != nil {
		s.metrics.unregister()
		return nil, fmt.Errorf("engine API: %w", err)
	}
	s.hs = newHTTPServer(s.mux(), s.log)
	go func() {
		defer close(s.served)
		if err := s.hs.Serve(s.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Error("engine API stopped serving", "err", err)
		}
	}()
	s.log.Info("engine API listening", "socket", cfg.Socket, "backend", s.be.Name(), "ranks", len(s.order))
	return s, nil
}

// The socket's server gives a connection headerTimeout to send its
// request's header, a request's body bodyTimeout to arrive (read or not),
// and closes a keep-alive connection idle for idleTimeout, as kvrouter's
// ports do; it sets no read or write timeout. Without the body's bound, a
// stalled local client that declared a body held its handler and
// connection until Close.
const (
	headerTimeout = 10 * time.Second
	idleTimeout   = 2 * time.Minute
)

// newHTTPServer returns the socket's server, serving h, its own errors
// (a connection's) logged to log at debug level.
func newHTTPServer(h http.Handler, log *slog.Logger) *http.Server {
	bounded := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		httpbody.Bound(w, r, bodyTimeout)
		h.ServeHTTP(w, r)
	})
	return &http.Server{Handler: bounded, ReadHeaderTimeout: headerTimeout, IdleTimeout: idleTimeout,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
}

func (s *Server) addRanks() error {
	if s.cfg.Socket == "" {
		return errors.New("no socket path")
	}
	if s.be == nil {
		return errors.New("no backend")
	}
	if len(s.cfg.Ranks) == 0 {
		return errors.New("no ranks")
	}
	for _, rp := range s.cfg.Ranks {
		sl := &rankSlot{rank: rp.Rank, host: rp.Host, disk: rp.Disk}
		switch {
		case rp.Host == nil && rp.Disk == nil:
			return fmt.Errorf("rank %s has neither a host nor a disk pool", rp.Rank)
		case s.ranks[rp.Rank.DP] != nil:
			return fmt.Errorf("dp rank %d listed twice", rp.Rank.DP)
		}
		if rp.Host != nil {
			sl.blockSize = rp.Host.Stats().BlockSize
			sl.paths = append(sl.paths, manager.D2H, manager.H2D)
			if rp.Disk != nil {
				sl.paths = append(sl.paths, manager.H2Disk)
			}
		} else {
			// H2D too: an onboard from G3 copies the staging buffer
			// into G1 on it (counted there, as the metrics list it).
			sl.paths = append(sl.paths, manager.D2Disk, manager.H2D)
		}
		if rp.Disk != nil {
			bs := rp.Disk.Stats().BlockSize
			if sl.blockSize != 0 && bs != sl.blockSize {
				return fmt.Errorf("rank %s: host pool blocks of %d bytes, disk pool blocks of %d", rp.Rank, sl.blockSize, bs)
			}
			sl.blockSize = bs
			sl.paths = append(sl.paths, manager.Disk2H)
		}
		var diskDown func() bool
		if d := rp.Disk; d != nil {
			// The pool is the server's: it stays down between Managers.
			diskDown = func() bool { return d.Err() != nil }
		}
		sl.idle = manager.IdleMetrics(rp.Rank, sl.paths, diskDown)
		if len(s.order) > 0 && s.order[0].blockSize != sl.blockSize {
			return fmt.Errorf("rank %s: blocks of %d bytes, rank %s: %d", rp.Rank, sl.blockSize, s.order[0].rank, s.order[0].blockSize)
		}
		s.ranks[rp.Rank.DP] = sl
		s.order = append(s.order, sl)
	}
	slices.SortFunc(s.order, func(a, b *rankSlot) int { return cmp.Compare(a.rank.DP, b.rank.DP) })
	return nil
}

// listenUnix listens on a Unix socket at path, removing a stale socket
// file first, and makes it 0600.
func listenUnix(path string) (net.Listener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("%s exists and is not a socket", path)
		}
		if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
			c.Close()
			return nil, fmt.Errorf("%s: another process is serving on it", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("remove the stale socket: %w", err)
		}
	}
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, err
	}
	// Between bind and chmod the socket has the umask's mode, and another
	// user could connect in that window: where that matters, put the
	// socket in a directory only the agent's user can enter.
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("chmod %s: %w", path, err)
	}
	return ln, nil
}

// Socket returns the path the server listens on.
func (s *Server) Socket() string { return s.cfg.Socket }

// Close stops the server: new requests are refused, every rank's region is
// shut down (blocks freed, Manager closed, region unmapped), handlers in
// flight finish, and the socket is removed. It waits for copies in flight
// (Manager.Close does) and returns only once every handler has returned;
// connections still busy after shutdownGrace are cut, which ends a handler
// blocked on a stalled client. A second Close returns the first one's
// result.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		s.hmu.Lock()
		s.hclosed = true
		s.hmu.Unlock()
		for _, sl := range s.order {
			sl.mu.Lock()
			sl.closed = true
			sl.mu.Unlock()
		}
		var errs []error
		for _, sl := range s.order {
			// A registration in progress finishes first; later ones see closed.
			sl.regMu.Lock()
			sl.mu.Lock()
			a := sl.cur
			sl.cur = nil
			sl.mu.Unlock()
			if a != nil {
				errs = append(errs, a.shutdown())
			}
			sl.regMu.Unlock()
		}
		ctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
		if err := s.hs.Shutdown(ctx); err != nil {
			s.hs.Close()
		}
		cancel()
		// hs.Close does not wait for handlers; their connections are cut,
		// so one blocked on the client returns now, and the others hold no
		// lock Close takes and wait on nothing it still has to do.
		if testHookCloseWait != nil {
			testHookCloseWait()
		}
		s.handlers.Wait()
		<-s.served
		s.metrics.unregister()
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}

func (s *Server) slot(dp uint32) (*rankSlot, error) {
	sl := s.ranks[dp]
	if sl == nil {
		return nil, fmt.Errorf("%w: %d", ErrUnknownRank, dp)
	}
	return sl, nil
}

// acquire returns the rank's attachment with a reference the caller drops
// with users.Done.
func (sl *rankSlot) acquire() (*attachment, error) {
	sl.mu.Lock()
	defer sl.mu.Unlock()
	switch {
	case sl.closed:
		return nil, ErrClosed
	case sl.cur == nil:
		return nil, fmt.Errorf("%w: dp rank %d (POST %s first)", ErrNotRegistered, sl.rank.DP, PathRegion)
	}
	sl.cur.users.Add(1)
	return sl.cur, nil
}

// detach unhooks a from the slot if it is still the current attachment.
func (sl *rankSlot) detach(a *attachment) {
	sl.mu.Lock()
	if sl.cur == a {
		sl.cur = nil
	}
	sl.mu.Unlock()
}

// register maps the region and starts the rank's Manager on it, replacing
// the previous registration. A refused request leaves the old registration
// in place, except in the one case where it must go first: CUDA maps a
// handle once per process, so re-registering the same handle unmaps the old
// mapping before mapping it again. The new manager's streams and staging
// buffers are made before the old manager closes, so a device out of them
// refuses the request and keeps the old registration; only the new
// manager's start waits for the old one to go. The managers register no
// metrics: rankMetrics exports the rank's, whichever manager runs.
func (s *Server) register(sl *rankSlot, h backend.IPCHandle, l manager.Layout) (bool, error) {
	sl.regMu.Lock()
	defer sl.regMu.Unlock()
	sl.mu.Lock()
	closed, old := sl.closed, sl.cur
	sl.mu.Unlock()
	if closed {
		return false, ErrClosed
	}
	shut := func() error {
		if old == nil {
			return nil
		}
		sl.detach(old)
		return old.shutdown()
	}
	replaced := old != nil
	if old != nil && s.be.Kind() == backend.KindCUDA && bytes.Equal(old.handle, h) {
		if err := shut(); err != nil {
			s.log.Warn("closing the replaced G1 region", "rank", sl.rank, "err", err)
		}
		old = nil
	}
	mp, err := manager.MapRegion(s.be, h, l)
	if err != nil {
		if errors.Is(err, backend.ErrClosed) {
			return false, fmt.Errorf("%w: %v", ErrClosed, err)
		}
		return false, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	cfg := s.cfg.Manager
	cfg.Rank, cfg.Backend, cfg.G1, cfg.Host, cfg.Disk = sl.rank, s.be, mp.Region, sl.host, sl.disk
	// The Manager registers nothing: the server's rankMetrics exports its
	// families, and the rank's at zero while it has no Manager.
	cfg.Registerer, cfg.Logger = nil, s.cfg.Logger
	pm, err := manager.Prepare(cfg)
	if err != nil {
		return false, errors.Join(fmt.Errorf("start the offload manager: %w", err), mp.Close())
	}
	// The old manager goes before the new one starts.
	if err := shut(); err != nil {
		s.log.Warn("closing the replaced G1 region", "rank", sl.rank, "err", err)
	}
	m, err := pm.Start()
	if err != nil {
		return false, errors.Join(fmt.Errorf("start the offload manager (the old registration is closed): %w", err), mp.Close())
	}
	a := &attachment{m: m, mp: mp, handle: slices.Clone(h), layout: l}
	sl.mu.Lock()
	closed = sl.closed
	if !closed {
		sl.cur = a
	}
	sl.mu.Unlock()
	if closed {
		return false, errors.Join(ErrClosed, a.shutdown())
	}
	s.log.Info("G1 region registered", "rank", sl.rank, "blocks", l.Blocks, "block_bytes", l.BlockSize, "replaced", replaced)
	return replaced, nil
}

// unregister shuts the rank's registration down; false if it had none.
func (s *Server) unregister(sl *rankSlot) (bool, error) {
	sl.regMu.Lock()
	defer sl.regMu.Unlock()
	sl.mu.Lock()
	closed, a := sl.closed, sl.cur
	sl.cur = nil
	sl.mu.Unlock()
	if closed {
		return false, ErrClosed
	}
	if a == nil {
		return false, nil
	}
	s.log.Info("G1 region unregistered", "rank", sl.rank)
	return true, a.shutdown()
}

// lookup asks the rank's pools directly, so it works with no region; it is
// refused once Close began.
func (sl *rankSlot) lookup(hs []uint64) ([]kvevent.Mask, error) {
	sl.mu.Lock()
	closed := sl.closed
	sl.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	out := make([]kvevent.Mask, len(hs))
	for _, p := range []struct {
		lookup func([]uint64, []bool) []bool
		tier   kvevent.Tier
	}{{hostLookup(sl.host), kvevent.TierHostPinned}, {diskLookup(sl.disk), kvevent.TierDisk}} {
		if p.lookup == nil {
			continue
		}
		for i, ok := range p.lookup(hs, nil) {
			if ok {
				out[i] |= p.tier.Bit()
			}
		}
	}
	return out, nil
}

func hostLookup(p *pool.HostPool) func([]uint64, []bool) []bool {
	if p == nil {
		return nil
	}
	return p.Lookup
}

func diskLookup(p *pool.DiskPool) func([]uint64, []bool) []bool {
	if p == nil {
		return nil
	}
	return p.Lookup
}

// The handlers. Each decodes its whole request, checks it against the
// rank's region, and only then calls the Manager.

func (s *Server) mux() *http.ServeMux {
	mux := http.NewServeMux()
	s.route(mux, http.MethodPost, PathRegion, s.handleRegister)
	s.route(mux, http.MethodPost, PathUnregister, s.handleUnregister)
	s.route(mux, http.MethodPost, PathOffload, s.handleOffload)
	s.route(mux, http.MethodPost, PathFree, s.handleFree)
	s.route(mux, http.MethodPost, PathLookup, s.handleLookup)
	s.route(mux, http.MethodPost, PathOnboard, s.handleOnboard)
	s.route(mux, http.MethodGet, PathStats, func(context.Context, []byte) (any, error) { return s.stats(), nil })
	s.route(mux, http.MethodGet, PathHealth, func(context.Context, []byte) (any, error) {
		return map[string]string{"status": "ok"}, nil
	})
	known := map[string]bool{PathRegion: true, PathUnregister: true, PathOffload: true, PathFree: true,
		PathLookup: true, PathOnboard: true, PathStats: true, PathHealth: true}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		e := &Error{Status: http.StatusNotFound, Code: codeNotFound, Message: "no such path: " + r.URL.Path}
		if known[r.URL.Path] {
			e = &Error{Status: http.StatusMethodNotAllowed, Code: codeMethod, Message: r.Method + " " + r.URL.Path + " is not allowed"}
		}
		s.reply(w, "other", time.Now(), e.Status, e)
	})
	return mux
}

type handler func(ctx context.Context, body []byte) (any, error)

func (s *Server) route(mux *http.ServeMux, method, path string, h handler) {
	mux.HandleFunc(method+" "+path, func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		// Counted in flight, so that Close waits for it (the pools are the
		// caller's to close once Close returns); refused once Close began.
		s.hmu.Lock()
		closed := s.hclosed
		if !closed {
			s.handlers.Add(1)
		}
		s.hmu.Unlock()
		if closed {
			e := classify(ErrClosed)
			s.reply(w, path, start, e.Status, e)
			return
		}
		defer s.handlers.Done()
		if testHookHandler != nil {
			testHookHandler(path)
		}
		body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
		var resp any
		if err != nil {
			err = fmt.Errorf("%w: reading the body: %v", ErrBadRequest, err)
		} else {
			resp, err = h(r.Context(), body)
		}
		if err != nil {
			e := classify(err)
			if e.Status >= 500 {
				s.log.Warn("engine API request failed", "path", path, "err", err)
			} else {
				s.log.Debug("engine API request refused", "path", path, "status", e.Status, "err", err)
			}
			s.reply(w, path, start, e.Status, e)
			return
		}
		s.reply(w, path, start, http.StatusOK, resp)
	})
}

func (s *Server) reply(w http.ResponseWriter, path string, start time.Time, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil { // our own types: cannot happen
		status, b = http.StatusInternalServerError, []byte(`{"error":"encoding the answer","code":"internal"}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	w.Write(append(b, '\n'))
	s.metrics.observe(path, status, time.Since(start))
}

// classify maps an error to its answer.
func classify(err error) *Error {
	e := &Error{Message: err.Error()}
	switch {
	case errors.Is(err, ErrBadRequest), errors.Is(err, manager.ErrInvalid), errors.Is(err, manager.ErrBadBlock):
		e.Status, e.Code = http.StatusBadRequest, codeBadRequest
	case errors.Is(err, ErrUnknownRank):
		e.Status, e.Code = http.StatusNotFound, codeUnknownRank
	case errors.Is(err, ErrNotRegistered), errors.Is(err, manager.ErrClosed):
		// manager.ErrClosed: the region was replaced or unregistered while
		// the request ran.
		e.Status, e.Code = http.StatusConflict, codeNotRegistered
	case errors.Is(err, ErrClosed):
		e.Status, e.Code = http.StatusServiceUnavailable, codeClosed
	default:
		e.Status, e.Code = http.StatusInternalServerError, codeInternal
	}
	return e
}

func (s *Server) handleRegister(_ context.Context, body []byte) (any, error) {
	q, err := decode[RegisterRequest](body, MaxRequestBlocks)
	if err != nil {
		return nil, err
	}
	sl, err := s.slot(q.DPRank)
	if err != nil {
		return nil, err
	}
	h, l, err := q.check(s.be.Kind(), sl.blockSize, s.cfg.MaxRegionBlocks)
	if err != nil {
		return nil, err
	}
	replaced, err := s.register(sl, h, l)
	if err != nil {
		return nil, err
	}
	return RegisterResponse{DPRank: q.DPRank, Replaced: replaced, Backend: string(s.be.Kind())}, nil
}

func (s *Server) handleUnregister(_ context.Context, body []byte) (any, error) {
	q, err := decode[UnregisterRequest](body, MaxRequestBlocks)
	if err != nil {
		return nil, err
	}
	sl, err := s.slot(q.DPRank)
	if err != nil {
		return nil, err
	}
	ok, err := s.unregister(sl)
	if err != nil && !ok {
		return nil, err
	}
	if err != nil { // the registration is gone; tell the operator, not the engine
		s.log.Warn("closing the unregistered G1 region", "rank", sl.rank, "err", err)
	}
	return UnregisterResponse{Unregistered: ok}, nil
}

// listLimit is the longest list a request about a region can need: a
// Free of MaxRequestBlocks ids, or an Offload, Onboard or Free naming
// every block of the largest region registered now. Each request's check
// bounds its lists again by its own rank's region; this bound only keeps
// a body that no region could take from being decoded whole.
func (s *Server) listLimit() int {
	most := MaxRequestBlocks
	for _, sl := range s.order {
		sl.mu.Lock()
		if sl.cur != nil {
			most = max(most, sl.cur.layout.Blocks)
		}
		sl.mu.Unlock()
	}
	return most
}

// regionRequest is a request about a rank's registered G1 region: its
// block ids are checked against the region's layout.
type regionRequest interface {
	rank() uint32
	check(blocks int) error
}

// withRegion decodes a Q from body, holds its rank's registered region
// (its manager stays open) while do runs, and runs do only when q's block
// ids fit the region's layout.
func withRegion[Q any, PQ interface {
	*Q
	regionRequest
}](s *Server, body []byte, do func(a *attachment, q PQ) (any, error)) (any, error) {
	q, err := decode[Q](body, s.listLimit())
	if err != nil {
		return nil, err
	}
	pq := PQ(&q)
	sl, err := s.slot(pq.rank())
	if err != nil {
		return nil, err
	}
	a, err := sl.acquire()
	if err != nil {
		return nil, err
	}
	defer a.users.Done()
	if err := pq.check(a.layout.Blocks); err != nil {
		return nil, err
	}
	return do(a, pq)
}

func (s *Server) handleOffload(_ context.Context, body []byte) (any, error) {
	return withRegion(s, body, func(a *attachment, q *OffloadRequest) (any, error) {
		if c := s.cfg.Checker; c != nil {
			r := s.ranks[q.DPRank].rank // withRegion found the slot
			for i, b := range q.Blocks {
				err := c.CheckOffload(r, uint64(b.Parent), kvevent.Block{EngineHash: uint64(b.Hash), LocalHash: uint64(b.Local)})
				if err != nil {
					return nil, fmt.Errorf("%w: blocks[%d]: %v", ErrBadRequest, i, err)
				}
			}
		}
		reqs := make([]manager.OffloadRequest, len(q.Blocks))
		for i, b := range q.Blocks {
			reqs[i] = manager.OffloadRequest{G1Block: b.G1Block, Hash: uint64(b.Hash), Parent: uint64(b.Parent),
				Local: uint64(b.Local), Priority: b.Priority}
		}
		res, err := a.m.Offload(reqs)
		if err != nil {
			return nil, err
		}
		return OffloadResponse{Queued: res.Queued, Shed: res.Shed, NoPriority: res.NoPriority,
			Duplicate: res.Duplicate, Cold: res.Cold, NoDisk: res.NoDisk}, nil
	})
}

func (s *Server) handleFree(_ context.Context, body []byte) (any, error) {
	return withRegion(s, body, func(a *attachment, q *FreeRequest) (any, error) {
		if err := a.m.Free(q.G1Blocks...); err != nil {
			return nil, err
		}
		return FreeResponse{Freed: len(q.G1Blocks)}, nil
	})
}

func (s *Server) handleLookup(_ context.Context, body []byte) (any, error) {
	q, err := decode[LookupRequest](body, MaxRequestBlocks)
	if err != nil {
		return nil, err
	}
	if err := q.check(); err != nil {
		return nil, err
	}
	sl, err := s.slot(q.DPRank)
	if err != nil {
		return nil, err
	}
	hs := make([]uint64, len(q.Hashes))
	for i, h := range q.Hashes {
		hs[i] = uint64(h)
	}
	masks, err := sl.lookup(hs)
	if err != nil {
		return nil, err
	}
	resp := LookupResponse{Tiers: make([][]string, len(hs)), Prefix: -1}
	for i, m := range masks {
		resp.Tiers[i] = []string{}
		for _, t := range []kvevent.Tier{kvevent.TierHostPinned, kvevent.TierDisk} {
			if m.Has(t) {
				resp.Tiers[i] = append(resp.Tiers[i], t.String())
			}
		}
		if m == 0 && resp.Prefix < 0 {
			resp.Prefix = i
		}
	}
	if resp.Prefix < 0 {
		resp.Prefix = len(hs)
	}
	return resp, nil
}

func (s *Server) handleOnboard(ctx context.Context, body []byte) (any, error) {
	return withRegion(s, body, func(a *attachment, q *OnboardRequest) (any, error) {
		hs := make([]uint64, len(q.Hashes))
		for i, h := range q.Hashes {
			hs[i] = uint64(h)
		}
		// The request's context has no deadline of its own: with
		// timeout_ms 0 the manager's OnboardTimeout applies; any other
		// timeout_ms is the deadline, longer or shorter than that.
		octx := ctx
		if q.TimeoutMs > 0 {
			var cancel context.CancelFunc
			octx, cancel = context.WithTimeout(ctx, time.Duration(q.TimeoutMs)*time.Millisecond)
			defer cancel()
		}
		res, err := a.m.Onboard(octx, hs, q.G1Blocks)
		if err != nil {
			return nil, err
		}
		resp := OnboardResponse{Blocks: make([]OnboardBlock, len(res.Blocks)), Loaded: res.Loaded(), Prefix: res.Prefix(),
			Settled: s.waitSettled(ctx, res.Settled)}
		for i, b := range res.Blocks {
			ob := OnboardBlock{Status: b.Status.String()}
			if b.Status != manager.NotFound {
				ob.From = b.From.String()
			}
			if b.Err != nil {
				ob.Error = b.Err.Error()
			}
			resp.Blocks[i] = ob
		}
		return resp, nil
	})
}

// waitSettled waits for an onboard's copies into G1 to finish, for at most
// SettleTimeout or until the caller goes away.
func (s *Server) waitSettled(ctx context.Context, settled <-chan struct{}) bool {
	select {
	case <-settled:
		return true
	default:
	}
	t := time.NewTimer(s.cfg.SettleTimeout)
	defer t.Stop()
	select {
	case <-settled:
		return true
	case <-t.C:
	case <-ctx.Done():
	}
	return false
}

func (s *Server) stats() StatsResponse {
	resp := StatsResponse{Backend: string(s.be.Kind()), Ranks: make([]RankStats, 0, len(s.order))}
	for _, sl := range s.order {
		rs := RankStats{DPRank: sl.rank.DP, BlockSizeBytes: sl.blockSize}
		if sl.host != nil {
			rs.Host = poolStats(sl.host.Stats())
		}
		if sl.disk != nil {
			rs.Disk = poolStats(sl.disk.Stats())
		}
		if a, err := sl.acquire(); err == nil {
			rs.Registered, rs.NumBlocks = true, a.layout.Blocks
			rs.Manager = managerStats(a.m.Stats(), sl.paths)
			a.users.Done()
		}
		resp.Ranks = append(resp.Ranks, rs)
	}
	return resp
}

func poolStats(st pool.Stats) *PoolStats {
	return &PoolStats{Capacity: st.Capacity, Used: st.Used, Pending: st.Pending, Referenced: st.Referenced,
		Inactive: st.Inactive, Evictable: st.Evictable, Hits: st.Hits, Misses: st.Misses,
		Registered: st.Registered, Revived: st.Revived, Evictions: st.Evictions, PublishErrors: st.PublishErrors,
		Damaged: st.Damaged}
}

func managerStats(st manager.Stats, paths []manager.Path) *ManagerStats {
	ms := &ManagerStats{Paths: make(map[string]CopyPathStats, len(paths)), Invalid: st.Invalid,
		NoPriority: st.NoPriority, Duplicates: st.Duplicates, Cold: st.Cold, NoDisk: st.NoDisk, DiskDown: st.DiskDown,
		Tracked: st.Tracked,
		Onboard: OnboardStats{Calls: st.Onboard.Calls, FromHost: st.Onboard.FromHost, FromDisk: st.Onboard.FromDisk,
			NotFound: st.Onboard.NotFound, TimedOut: st.Onboard.TimedOut, Canceled: st.Onboard.Canceled,
			Failed: st.Onboard.Failed, LateWrites: st.Onboard.LateWrites}}
	for _, p := range paths {
		ps := st.Paths[p]
		ms.Paths[p.String()] = CopyPathStats{Depth: ps.Depth, InFlight: ps.InFlight, Queued: ps.Queued, Shed: ps.Shed,
			Skipped: ps.Skipped, Exists: ps.Exists, Full: ps.Full, Failed: ps.Failed, Blocks: ps.Blocks, Bytes: ps.Bytes}
	}
	return ms
}

// serverMetrics counts requests by path and status.
type serverMetrics struct {
	requests   *prometheus.CounterVec
	duration   *prometheus.HistogramVec
	unregister func()
}

// rankMetrics exports each rank's Manager families (kvagent_offload_*,
// kvagent_onboard_blocks_total): its Manager's while the engine has a
// region registered, else the same series at zero (manager.IdleMetrics).
// An agent whose engine has not registered yet, or has gone, thus shows
// every family, and a panel or an alert over one reads 0, not "no data".
// It is registered once: a Manager that registered its own on each
// registration left the families without series until the first, and a
// scrape between an old Manager's and a new one's could see both.
type rankMetrics []*rankSlot

func (rm rankMetrics) Describe(ch chan<- *prometheus.Desc) {
	for _, sl := range rm {
		sl.idle.Describe(ch) // the Manager's are the same
	}
}

func (rm rankMetrics) Collect(ch chan<- prometheus.Metric) {
	for _, sl := range rm {
		sl.mu.Lock()
		a := sl.cur
		sl.mu.Unlock()
		if a != nil {
			a.m.Collector().Collect(ch)
		} else {
			sl.idle.Collect(ch)
		}
	}
}

func newServerMetrics(reg prometheus.Registerer, slots []*rankSlot) (*serverMetrics, error) {
	m := &serverMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvagent_engineapi_requests_total",
			Help: "Engine API requests, by path and HTTP status."}, []string{"path", "status"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "kvagent_engineapi_request_duration_seconds",
			Help:    "Time to answer an engine API request (an onboard includes its copies).",
			Buckets: prometheus.ExponentialBuckets(20e-6, 4, 10)}, []string{"path"}),
		unregister: func() {},
	}
	if reg == nil {
		return m, nil
	}
	if err := reg.Register(m.requests); err != nil {
		return nil, err
	}
	if err := reg.Register(m.duration); err != nil {
		reg.Unregister(m.requests)
		return nil, err
	}
	ranks := rankMetrics(slots)
	if err := reg.Register(ranks); err != nil {
		reg.Unregister(m.requests)
		reg.Unregister(m.duration)
		return nil, fmt.Errorf("register the ranks' offload metrics: %w", err)
	}
	m.unregister = func() {
		reg.Unregister(m.requests)
		reg.Unregister(m.duration)
		reg.Unregister(ranks)
	}
	return m, nil
}

func (m *serverMetrics) observe(path string, status int, d time.Duration) {
	m.requests.WithLabelValues(path, strconv.Itoa(status)).Inc()
	m.duration.WithLabelValues(path).Observe(d.Seconds())
}
