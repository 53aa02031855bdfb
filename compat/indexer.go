package compat

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/kvrouter/kvrouter/api"
	"github.com/kvrouter/kvrouter/enginesub"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/jsonscan"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

// RegisterRequest is the body of POST /register: one dp rank of an engine
// instance, for a (model, tenant).
type RegisterRequest struct {
	InstanceID     uint64  `json:"instance_id"`
	Endpoint       string  `json:"endpoint"` // the engine's ZMQ event endpoint, tcp://host:port
	ModelName      string  `json:"model_name"`
	TenantID       string  `json:"tenant_id,omitempty"`
	RoutingGroup   string  `json:"routing_group,omitempty"` // alias of tenant_id
	BlockSize      int     `json:"block_size"`
	DPRank         *uint32 `json:"dp_rank,omitempty"`
	ReplayEndpoint string  `json:"replay_endpoint,omitempty"`
	AdditionalSalt string  `json:"additional_salt,omitempty"`
	// AdditionalSaltAlias is additional_salt under Mooncake's name, which
	// Dynamo's indexer accepts too: dropped as an unknown key, a salted
	// registration registered unsalted. Both given must agree (saltOf).
	AdditionalSaltAlias string `json:"additionalsalt,omitempty"`
	// Agentless (default true): the cluster's leader subscribes to
	// Endpoint itself. false: the instance's events come through
	// POST /events or a kvagent, with contiguous event ids.
	Agentless *bool `json:"agentless,omitempty"`
}

// UnregisterRequest is the body of POST /unregister. Without tenant_id the
// instance leaves every tenant of the model; without dp_rank, every rank.
type UnregisterRequest struct {
	InstanceID   uint64  `json:"instance_id"`
	ModelName    string  `json:"model_name"`
	TenantID     string  `json:"tenant_id,omitempty"`
	RoutingGroup string  `json:"routing_group,omitempty"` // tenant_id's alias
	DPRank       *uint32 `json:"dp_rank,omitempty"`
}

// Instance is one entry of GET /workers: an instance and its event
// endpoint per dp rank, over every (model, tenant) it is registered for.
type Instance struct {
	InstanceID uint64      `json:"instance_id"`
	Endpoints  Map[string] `json:"endpoints"`
}

// QueryRequest is the body of POST /query: a prompt's token ids, hashed
// here with the namespace's block size and the LoRA name and salt.
type QueryRequest struct {
	TokenIDs     []uint32 `json:"token_ids"`
	ModelName    string   `json:"model_name"`
	TenantID     string   `json:"tenant_id,omitempty"`
	RoutingGroup string   `json:"routing_group,omitempty"` // tenant_id's alias
	LoRAName     string   `json:"lora_name,omitempty"`
	CacheSalt    string   `json:"cache_salt,omitempty"`
}

// QueryByHashRequest is the body of POST /query_by_hash: the content
// hashes of the prompt's full blocks.
type QueryByHashRequest struct {
	BlockHashes  []Hash `json:"block_hashes"`
	ModelName    string `json:"model_name"`
	TenantID     string `json:"tenant_id,omitempty"`
	RoutingGroup string `json:"routing_group,omitempty"` // tenant_id's alias
	// CacheSalt must be absent or null: the hashes were computed by the
	// caller, and a salt cannot be applied to them after the fact. A
	// request naming one (even "") is refused, as Dynamo's indexer
	// refuses it, rather than answered with unsalted scores the caller
	// would take for salted ones.
	CacheSalt *string `json:"cache_salt,omitempty"`
}

// errHashSalt refuses a /query_by_hash (or the selection API's
// /overlap_scores, the same answer) that names a cache_salt.
var errHashSalt = errors.New("cache_salt must be omitted or null where block hashes are given: " +
	"a salt cannot apply to block hashes already computed; hash the salted prompt, or POST /query with its token ids")

// scanJSON reads the common shape of the body in one pass (jsonScanner):
// the hot path of /query_by_hash.
func (q *QueryByHashRequest) scanJSON(b []byte) bool {
	*q = QueryByHashRequest{}
	p := jsonscan.New(b)
	return p.Object(func(key []byte) bool {
		ok := false
		switch string(key) { // no allocation: only compared
		case "block_hashes":
			// Straight into the request's type: null gives nil, []
			// an empty slice, as encoding/json.
			q.BlockHashes, ok = jsonscan.Int64sOf(p, q.BlockHashes)
		case "model_name":
			q.ModelName, ok = p.Text()
		case "tenant_id":
			q.TenantID, ok = p.Text()
		case "routing_group":
			q.RoutingGroup, ok = p.Text()
		case "cache_salt":
			// null is none, as encoding/json reads it; a value goes
			// to encoding/json, and is refused (errHashSalt).
			ok = p.Null()
		default:
			return false
		}
		return ok
	})
}

// QueryResponse answers both queries. Every figure is in tokens (blocks ×
// block size).
type QueryResponse struct {
	// Scores is each instance's matched prefix per dp rank on the device
	// (GPU) tier, as Dynamo defines it: a rank whose prefix is only on
	// host or disk scores 0.
	Scores Map[Map[int]] `json:"scores"`
	// Frequencies[d] is how many ranks of the namespace hold the prompt's
	// block d at the end of a matched prefix or beyond it.
	Frequencies []int `json:"frequencies"`
	// Instances is each instance's overlap by tier.
	Instances Map[InstanceOverlap] `json:"instances"`
}

// InstanceOverlap is an instance's matched prefix by tier, the best over
// its dp ranks. The walk goes device, then host, then disk: CPU and Disk
// are cumulative (GPU ≤ CPU ≤ Disk ≤ LongestMatched).
type InstanceOverlap struct {
	LongestMatched int `json:"longest_matched"`
	GPU            int `json:"gpu"`
	// DP is each dp rank's device (GPU) run, as Scores.
	DP   Map[int] `json:"dp"`
	CPU  int      `json:"cpu"`
	Disk int      `json:"disk"`
}

// MarshalJSON writes the answer as encoding/json would (keys of every map
// sorted, the fields in declaration order) without its reflection over
// maps: this answer is the hot path of /query and /query_by_hash.
func (q QueryResponse) MarshalJSON() ([]byte, error) {
	b := make([]byte, 0, 64+48*len(q.Instances)+8*len(q.Frequencies))
	b = append(b, `{"scores":`...)
	b = appendMap(b, q.Scores, appendIntMap)
	b = append(b, `,"frequencies":`...)
	if q.Frequencies == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '[')
		for i, f := range q.Frequencies {
			if i > 0 {
				b = append(b, ',')
			}
			b = strconv.AppendInt(b, int64(f), 10)
		}
		b = append(b, ']')
	}
	b = append(b, `,"instances":`...)
	b = appendMap(b, q.Instances, func(b []byte, o InstanceOverlap) []byte { return o.appendJSON(b) })
	return append(b, '}'), nil
}

// MarshalJSON writes o as encoding/json would.
func (o InstanceOverlap) MarshalJSON() ([]byte, error) { return o.appendJSON(nil), nil }

func (o InstanceOverlap) appendJSON(b []byte) []byte {
	b = append(b, `{"longest_matched":`...)
	b = strconv.AppendInt(b, int64(o.LongestMatched), 10)
	b = append(b, `,"gpu":`...)
	b = strconv.AppendInt(b, int64(o.GPU), 10)
	b = append(b, `,"dp":`...)
	b = appendIntMap(b, o.DP)
	b = append(b, `,"cpu":`...)
	b = strconv.AppendInt(b, int64(o.CPU), 10)
	b = append(b, `,"disk":`...)
	b = strconv.AppendInt(b, int64(o.Disk), 10)
	return append(b, '}')
}

func appendIntMap(b []byte, m Map[int]) []byte {
	return appendMap(b, m, func(b []byte, v int) []byte { return strconv.AppendInt(b, int64(v), 10) })
}

// appendMap writes m as a JSON object with its keys sorted, each value by
// appendV.
func appendMap[V any](b []byte, m Map[V], appendV func([]byte, V) []byte) []byte {
	if m == nil {
		return append(b, "null"...)
	}
	b = append(b, '{')
	for i, k := range slices.Sorted(maps.Keys(m)) {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendQuote(b, k)
		b = append(b, ':')
		b = appendV(b, m[k])
	}
	return append(b, '}')
}

// EventsRequest is the body of POST /events: router events of one
// instance, through each rank's cursor as on NATS.
type EventsRequest struct {
	InstanceID   uint64  `json:"instance_id"`
	ModelName    string  `json:"model_name,omitempty"`
	TenantID     string  `json:"tenant_id,omitempty"`
	RoutingGroup string  `json:"routing_group,omitempty"` // tenant_id's alias
	BlockSize    int     `json:"block_size,omitempty"`
	Events       []Event `json:"events"`
}

// Event is one KV event. Type is "stored", "removed" or "cleared"; Medium
// the tier ("GPU" when absent; see kvevent.ParseMedium).
type Event struct {
	InstanceID  *uint64 `json:"instance_id,omitempty"` // GET /dump's; posted, the body's instance or none
	DPRank      uint32  `json:"dp_rank"`
	EventID     uint64  `json:"event_id"`
	Type        string  `json:"type"`
	Medium      string  `json:"medium,omitempty"`
	ParentHash  *Hash   `json:"parent_hash,omitempty"`
	Blocks      []Block `json:"blocks,omitempty"`
	BlockHashes []Hash  `json:"block_hashes,omitempty"` // removed
}

// Block is one stored block: the engine's block hash and the content hash
// of its tokens.
type Block struct {
	BlockHash  Hash `json:"block_hash"`
	TokensHash Hash `json:"tokens_hash"`
}

// EventsResponse answers POST /events.
type EventsResponse struct {
	Status string     `json:"status"`
	Acks   []EventAck `json:"acks"`
}

// EventAck is what the cluster did with one rank's events.
type EventAck struct {
	DPRank     uint32 `json:"dp_rank"`
	Cursor     uint64 `json:"cursor"`
	Applied    int    `json:"applied"`
	Duplicates int    `json:"duplicates"`
	Gap        bool   `json:"gap"`
	// Resync: the rank lost stores the router held for it (their parent
	// never came); its state is short of them until a dump replaces it.
	Resync bool `json:"resync,omitempty"`
}

// DumpNamespace is one "<model>:<tenant>" entry of GET /dump (dumpKey).
type DumpNamespace struct {
	BlockSize int     `json:"block_size"`
	Events    []Event `json:"events"`
}

// Event types.
const (
	typeStored  = "stored"
	typeRemoved = "removed"
	typeCleared = "cleared"
)

// Indexer serves the KV-indexer API of Dynamo's standalone indexer from
// the replicated state (docs/compat.md says where it differs).
type Indexer struct {
	b   Backend
	log *slog.Logger

	// regMu serialises the read-modify-writes of b's worker table made
	// in this process, by every API of b (regLock).
	regMu *sync.Mutex
	pool  sync.Pool // *queryScratch
	ns    namespaces
}

// regLock returns the lock of b's worker-table writes: the indexer API
// and the selection API (which has an Indexer of its own) of one node
// edit the same worker table, read then written, and must not interleave
// (a PATCH lost a rank that a /register between its read and its write
// had added). A node's own lock (raftfsm.Node.WorkersMutex) also orders
// its /v1 registrations and lease removals; other backends get one lock
// each, shared by their APIs.
func regLock(b Backend) *sync.Mutex {
	if l, ok := b.(interface{ WorkersMutex() *sync.Mutex }); ok {
		return l.WorkersMutex()
	}
	m, _ := regLocks.LoadOrStore(b, new(sync.Mutex))
	return m.(*sync.Mutex)
}

var regLocks sync.Map // Backend → *sync.Mutex, for backends without their own

type queryScratch struct {
	local   []uint64
	matches indexer.Matches
}

// NewIndexer returns the indexer API of b. Mount it with Routes.
func NewIndexer(b Backend, log *slog.Logger) *Indexer {
	if log == nil {
		log = slog.Default()
	}
	x := &Indexer{b: b, log: log, regMu: regLock(b)}
	x.pool.New = func() any { return new(queryScratch) }
	return x
}

// Routes registers the API's routes on r under prefix ("" for the root).
// GET /metrics is the node's own and not registered here. POST /unregister
// is not safe twice (a second answers 404 for what the first removed):
// it is registered with HandleFuncOnce.
func (x *Indexer) Routes(r Router, prefix string) {
	r.CheckWorkers(x.checkV1Worker)
	r.HandleErrors(prefix, WriteError)
	r.HandleFunc("POST "+prefix+"/register", bodyHandler(http.StatusCreated, func(ctx context.Context, req *RegisterRequest) (any, error) {
		return statusOK, x.doRegister(ctx, req)
	}))
	r.HandleFuncOnce("POST "+prefix+"/unregister", bodyHandler(http.StatusOK, func(ctx context.Context, req *UnregisterRequest) (any, error) {
		return statusOK, x.doUnregister(ctx, req)
	}))
	r.HandleFunc("GET "+prefix+"/workers", x.workers)
	r.HandleFunc("POST "+prefix+"/query", bodyHandler(http.StatusOK, x.query))
	r.HandleFunc("POST "+prefix+"/query_by_hash", bodyHandler(http.StatusOK, x.queryByHash))
	r.HandleFunc("POST "+prefix+"/events", bodyHandler(http.StatusOK, func(ctx context.Context, req *EventsRequest) (any, error) {
		return x.doEvents(ctx, req)
	}))
	r.HandleFunc("GET "+prefix+"/dump", x.dump)
	r.HandleFunc("GET "+prefix+"/health", x.health)
}

// httpError is an error answer.
type httpError struct {
	code int
	err  error
}

func (e *httpError) Error() string { return e.err.Error() }
func (e *httpError) Unwrap() error { return e.err }

func badRequest(format string, args ...any) error {
	return &httpError{code: http.StatusBadRequest, err: fmt.Errorf(format, args...)}
}

// answer writes v, or the error err as {"error": ...}. An error that
// wraps raftfsm.ErrNotLeader is returned for the server to forward, and
// so is one whose write may have applied (a *raftfsm.NotLeaderError with
// MaybeApplied: its node lost its leadership or closed with the write in
// its log), for the server to answer with api.HeaderMaybeApplied on a
// route not safe twice.
func answer(w http.ResponseWriter, c codec, code int, v any, err error) error {
	if err == nil {
		return write(w, c, code, v)
	}
	var nle *raftfsm.NotLeaderError
	if errors.Is(err, raftfsm.ErrNotLeader) || errors.As(err, &nle) && nle.MaybeApplied {
		return err
	}
	var he *httpError
	switch {
	case errors.As(err, &he):
		code = he.code
	case errors.Is(err, errBody), errors.Is(err, raftfsm.ErrInvalid):
		code = http.StatusBadRequest
	case errors.Is(err, raftfsm.ErrUnknownWorker), errors.Is(err, indexer.ErrUnknownRank):
		code = http.StatusNotFound
	case errors.Is(err, raftfsm.ErrBookingFreed), errors.Is(err, raftfsm.ErrBookedElsewhere),
		errors.Is(err, raftfsm.ErrBlockSizeConflict):
		code = http.StatusConflict
	case errors.Is(err, indexer.ErrNoWorkers), errors.Is(err, indexer.ErrOverloaded):
		code = routeRefusalStatus(err)
	case errors.Is(err, raftfsm.ErrNoLeader), errors.Is(err, context.DeadlineExceeded):
		code = http.StatusServiceUnavailable
	case errors.Is(err, raftfsm.ErrInsufficientStorage): // ErrTooManyRanks, as /v1 answers it
		code = http.StatusInsufficientStorage
	default:
		code = http.StatusInternalServerError
	}
	return write(w, c, code, ErrorBody{Error: err.Error()})
}

// WriteError writes an error the Router answers for a request under an
// API's prefix (a missing token, no route, a body past its limit, no
// leader) in MessagePack, for a MessagePack request: the answer uses the
// request's encoding, which the Router's JSON error did not. A JSON
// request's is the Router's (false). A server that answers before the
// APIs are mounted (a node starting) calls it too, for the same promise
// (docs/compat.md).
func WriteError(w http.ResponseWriter, r *http.Request, code int, msg string) bool {
	c := codecOf(r)
	if c != codecMsgpack {
		return false
	}
	return write(w, c, code, ErrorBody{Error: msg}) == nil
}

// tenantOf is the namespace's tenant a request names with tenant_id or
// routing_group, its alias (DefaultTenant when neither): every endpoint
// reads the pair through it, so that a /register and the /events,
// queries and /unregister after it cannot pick differently. Both given
// and different is a 400 naming both: kvrouter took tenant_id and
// Dynamo's indexer takes routing_group, so either pick would answer a
// namespace some client did not mean.
func tenantOf(tenant, group string) (string, error) {
	if tenant != "" && group != "" && tenant != group {
		return "", badRequest("tenant_id %q and routing_group %q differ: they are one field under two names; send one", tenant, group)
	}
	return orDefaultTenant(cmp.Or(group, tenant)), nil
}

// orDefaultTenant is tenant, or DefaultTenant when it is empty.
func orDefaultTenant(tenant string) string {
	return cmp.Or(tenant, DefaultTenant)
}

// checkEndpoint accepts a ZMQ endpoint to connect to: tcp://host:port or
// ipc://path, read as libzmq reads it, not as a URL (libzmq takes a '%'
// that is no URL escape: an IPv6 zone, tcp://[fe80::1%eth0]:5557, or an
// ipc path's). The scheme is what precedes the first "://", tcp or ipc in
// lower case. A tcp endpoint's port follows its last ':' (1 to 65535), and
// its host is nothing more (no user, path, query or fragment, which ZMQ
// would read as part of the host) and no wildcard: "*" binds every
// interface, and a subscriber cannot connect to it (in libzmq's
// source;host form, the host after the last ';', which must not be
// empty). An ipc endpoint's path
// is the rest, as written. Beyond that it applies the rules libzmq's
// connect applies (checkZMQAddress), so that a registration it accepts is
// one the subscriber can follow.
func checkEndpoint(what, ep string) error {
	if err := checkName(what, ep); err != nil {
		return err
	}
	scheme, addr, ok := strings.Cut(ep, "://")
	if !ok {
		scheme = ""
	}
	switch scheme {
	case "tcp":
		i := strings.LastIndexByte(addr, ':')
		if i < 0 {
			return badRequest("%s %q: want tcp://host:port", what, ep)
		}
		host, portStr := addr[:i], addr[i+1:]
		if strings.ContainsAny(host, "@/?#") || strings.ContainsAny(portStr, "/?#") {
			return badRequest("%s %q: want tcp://host:port, without a user, path, query or fragment", what, ep)
		}
		port, perr := strconv.ParseUint(portStr, 10, 16)
		if perr != nil || port == 0 {
			return badRequest("%s %q: want tcp://host:port with a port of 1 to 65535", what, ep)
		}
		switch dest := host[strings.LastIndexByte(host, ';')+1:]; dest {
		case "":
			// tcp://eth0;:5557 too: libzmq takes it, and connects to no host.
			return badRequest("%s %q: want tcp://host:port (tcp://source;host:port: a host after the ';')", what, ep)
		case "*":
			return badRequest("%s %q: want the engine's address, not the wildcard it binds", what, ep)
		}
	case "ipc":
		if addr == "" {
			return badRequest("%s %q: want ipc://path", what, ep)
		}
	default:
		return badRequest("%s %q: want tcp://host:port or ipc://path", what, ep)
	}
	if p := checkZMQAddress(scheme, addr); p != "" {
		return badRequest("%s %q: libzmq refuses %s", what, ep, p)
	}
	// The agentless subscriber checks its endpoints with CheckEndpoint
	// (enginesub.New): a registration it would refuse is never followed.
	// The checks above refuse all it refuses; this keeps it so.
	if err := enginesub.CheckEndpoint(ep, false); err != nil {
		return badRequest("%s %q: the subscriber refuses it: %v", what, ep, err)
	}
	return nil
}

// maxIPCPath is the longest ipc path libzmq connects to: a Unix socket
// address's sun_path (108 bytes on Linux) less its terminating NUL.
const maxIPCPath = 107

// checkZMQAddress applies the checks libzmq's zmq_connect makes of a tcp
// or ipc address (the endpoint past "tcp://" or "ipc://") before it
// accepts it, and says what breaks one, or "" (socket_base.cpp,
// ipc_address.cpp, libzmq 4.3): a tcp address starts with an ASCII letter
// or digit, '[' or ':', and holds only those and . - _ : % ; [ ] *; an ipc
// path fits sun_path, and is not "@" alone (an abstract socket without a
// name). Refused, zmq_connect fails at once (EINVAL, ENAMETOOLONG), and a
// subscriber could never follow the engine.
func checkZMQAddress(scheme, addr string) string {
	switch scheme {
	case "tcp":
		for i := 0; i < len(addr); i++ {
			c := addr[i]
			alnum := 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9'
			switch {
			case alnum || c == '[' || c == ':':
			case i == 0:
				return fmt.Sprintf("a tcp host that starts with %q: want an ASCII letter or digit, or '[' for an IPv6 address", c)
			case !strings.ContainsRune(".-_%;]*", rune(c)):
				return fmt.Sprintf("%q in a tcp host: want ASCII letters, digits and . - _ : %% ; [ ] only", c)
			}
		}
	case "ipc":
		if len(addr) > maxIPCPath {
			return fmt.Sprintf("an ipc path of %d bytes: a Unix socket path holds %d at most", len(addr), maxIPCPath)
		}
		if addr == "@" {
			return "an abstract ipc socket without a name"
		}
	}
	return ""
}

func (x *Indexer) doRegister(ctx context.Context, req *RegisterRequest) error {
	if err := x.b.CheckLeader(); err != nil {
		return err
	}
	if err := requireModel(req.ModelName, req.TenantID, req.RoutingGroup); err != nil {
		return err
	}
	salt, err := saltOf(req)
	if err != nil {
		return err
	}
	if req.BlockSize <= 0 || req.BlockSize > 1<<20 {
		return badRequest("block_size %d: want 1 to %d tokens", req.BlockSize, 1<<20)
	}
	if err := checkEndpoint("endpoint", req.Endpoint); err != nil {
		return err
	}
	if req.ReplayEndpoint != "" {
		if err := checkEndpoint("replay_endpoint", req.ReplayEndpoint); err != nil {
			return err
		}
	}
	tenant, err := tenantOf(req.TenantID, req.RoutingGroup)
	if err != nil {
		return err
	}
	dp := uint32(0)
	if req.DPRank != nil {
		dp = *req.DPRank
	}
	id := WorkerID(req.InstanceID, req.ModelName, tenant)

	for _, f := range [...]struct{ what, name string }{
		{"model_name", req.ModelName}, {"tenant_id", req.TenantID}, {"routing_group", req.RoutingGroup},
	} {
		if err := checkPrintable(f.what, f.name); err != nil {
			return err
		}
	}

	x.regMu.Lock()
	defer x.regMu.Unlock()
	table := x.b.WorkerTable()
	old, exists := table[id]
	agentless := req.Agentless == nil || *req.Agentless
	nw := raftfsm.WorkerInfo{ID: id, Instance: req.InstanceID, Model: req.ModelName, Tenant: tenant,
		BlockSize: req.BlockSize, Salt: salt, Positional: agentless}
	if !exists {
		if err := joinsNamespace(table, &nw); err != nil {
			return err
		}
	}
	if exists {
		if old.Instance != req.InstanceID || old.Model != req.ModelName || old.Tenant != tenant {
			return &httpError{code: http.StatusConflict, err: fmt.Errorf("worker id %#x is taken by another registration", id)}
		}
		if old.Positional != agentless {
			return &httpError{code: http.StatusConflict, err: fmt.Errorf(
				"instance %d is registered for %s/%s with agentless %v", req.InstanceID, req.ModelName, tenant, old.Positional)}
		}
		// The 409 names what differs. The salt registered is not echoed:
		// it keys the instance's hashes, and the caller asked with another.
		if old.BlockSize != req.BlockSize {
			return &httpError{code: http.StatusConflict, err: fmt.Errorf(
				"instance %d is registered for %s/%s with block_size %d, not %d",
				req.InstanceID, req.ModelName, tenant, old.BlockSize, req.BlockSize)}
		}
		if old.Salt != salt {
			return &httpError{code: http.StatusConflict, err: fmt.Errorf(
				"instance %d is registered for %s/%s with another additional_salt",
				req.InstanceID, req.ModelName, tenant)}
		}
		if ep, ok := old.EventEndpoints[dp]; ok {
			// The 409 names what differs: the event endpoint, or else the
			// replay endpoint (one that differed alone was answered with
			// the event endpoint, which both requests share).
			what, was := "endpoint", ep
			if ep == req.Endpoint {
				what, was = "replay_endpoint", cmp.Or(old.ReplayEndpoints[dp], "(none)")
			}
			if ep != req.Endpoint || old.ReplayEndpoints[dp] != req.ReplayEndpoint {
				return &httpError{code: http.StatusConflict, err: fmt.Errorf(
					"instance %d dp rank %d is registered for %s/%s with %s %s", req.InstanceID, dp,
					req.ModelName, tenant, what, was)}
			}
			return nil // the same registration again
		}
		// A rank registered without an event endpoint (through the
		// selection API) gets this one; a new rank joins.
		nw = old
		nw.DPRanks = slices.Clone(old.DPRanks)
		nw.EventEndpoints = maps.Clone(old.EventEndpoints)
		nw.ReplayEndpoints = maps.Clone(old.ReplayEndpoints)
	}
	if !slices.Contains(nw.DPRanks, dp) {
		if len(nw.DPRanks) >= maxDPRanks {
			return badRequest("instance %d has %d dp ranks for %s/%s (at most %d)", req.InstanceID, len(nw.DPRanks),
				req.ModelName, tenant, maxDPRanks)
		}
		nw.DPRanks = append(nw.DPRanks, dp)
		slices.Sort(nw.DPRanks)
	}
	if nw.EventEndpoints == nil {
		nw.EventEndpoints = map[uint32]string{}
	}
	nw.EventEndpoints[dp] = req.Endpoint
	if req.ReplayEndpoint != "" {
		if nw.ReplayEndpoints == nil {
			nw.ReplayEndpoints = map[uint32]string{}
		}
		nw.ReplayEndpoints[dp] = req.ReplayEndpoint
	}
	if err := x.b.RegisterWorker(ctx, nw); err != nil {
		return fmt.Errorf("register instance %d: %w", req.InstanceID, err)
	}
	return nil
}

// saltOf is the registration's salt: additional_salt, or its alias
// additionalsalt; both given and different is a 400.
func saltOf(req *RegisterRequest) (string, error) {
	for _, f := range [...]struct{ what, salt string }{
		{"additional_salt", req.AdditionalSalt}, {"additionalsalt", req.AdditionalSaltAlias},
	} {
		if err := checkName(f.what, f.salt); err != nil {
			return "", err
		}
	}
	if req.AdditionalSalt != "" && req.AdditionalSaltAlias != "" && req.AdditionalSalt != req.AdditionalSaltAlias {
		return "", badRequest("additional_salt and additionalsalt differ: they are one field under two names; send one")
	}
	return cmp.Or(req.AdditionalSalt, req.AdditionalSaltAlias), nil
}

// joinsNamespace checks that w, new to the table, fits its namespace: one
// block size for all (the namespace's queries hash and score with one),
// and an instance id no /v1 worker of the namespace has (a /v1 worker is
// the instance of its own id there, and answers are keyed by instance).
// Both registration APIs call it, under regMu; /v1 registrations keep the
// same rules (checkV1Worker).
func joinsNamespace(table map[uint64]raftfsm.WorkerInfo, w *raftfsm.WorkerInfo) error {
	if err := keepsBlockSize(table, w); err != nil {
		return err
	}
	instance, tenant := instanceOf(w.ID, w)
	for wid := range table {
		o := table[wid]
		if inst, ot := instanceOf(wid, &o); o.Model == w.Model && ot == tenant && inst == instance {
			return &httpError{code: http.StatusConflict, err: fmt.Errorf(
				"instance %d of %s/%s is a worker registered through /v1/workers", instance, w.Model, tenant)}
		}
	}
	return nil
}

// checkV1Worker holds a /v1 registration (api.Server.CheckWorkers) to the
// namespace rules that joinsNamespace holds the compatible APIs' to: a /v1
// worker is the instance of its own id in the default tenant of its model,
// and one of another block size than the namespace's, or of the id of an
// instance registered there through the compatible APIs, would change the
// block size the namespace's queries hash with (the smallest worker id's,
// namespaceOf) or answer as that instance beside it. It runs under regMu
// (the api holds the worker-table lock) and judges the leader's table.
func (x *Indexer) checkV1Worker(w raftfsm.WorkerInfo) error {
	if err := x.b.CheckLeader(); err != nil {
		return err
	}
	table := x.b.WorkerTable()
	old, ok := table[w.ID]
	if ok && old.Tenant != "" {
		// A /v1 registration would replace it, dropping it from its
		// namespace.
		return fmt.Errorf("%w: worker %d is instance %d of %s/%s, registered through the compatible APIs (docs/compat.md)",
			api.ErrConflict, w.ID, old.Instance, old.Model, old.Tenant)
	}
	if w.Model == "" {
		// In no namespace the compatible APIs serve: they require a model.
		return nil
	}
	if ok && old.Model == w.Model && old.BlockSize == w.BlockSize {
		// Nothing the rules judge changes: a worker that broke them before
		// they held for /v1 (an upgrade) still re-registers (kvagent does
		// at every start) while it is registered. Once removed (its lease
		// ran out) it is judged as new: exempting it would take a record
		// of removed workers kept for ever, and the namespace it returns
		// to may have been fixed meanwhile. kvagent logs the 409's fix.
		return nil
	}
	if err := keepsBlockSize(table, &w); err != nil {
		return fmt.Errorf("%w: worker %d: %w", api.ErrConflict, w.ID, err)
	}
	for wid := range table {
		o := table[wid]
		if o.Tenant == DefaultTenant && o.Model == w.Model && o.Instance == w.ID {
			return fmt.Errorf("%w: instance %d of %s/%s is registered through the compatible APIs (worker %d)",
				api.ErrConflict, w.ID, w.Model, DefaultTenant, wid)
		}
	}
	return nil
}

// keepsBlockSize checks that every other worker of w's namespace serves
// w's block size, or none. A /v1 worker without a model is in no
// namespace the compatible APIs serve (they require a model): nothing to
// keep.
func keepsBlockSize(table map[uint64]raftfsm.WorkerInfo, w *raftfsm.WorkerInfo) error {
	if w.Model == "" {
		return nil
	}
	_, tenant := instanceOf(w.ID, w)
	for wid := range table {
		o := table[wid]
		inst, ot := instanceOf(wid, &o)
		if wid == w.ID || o.Model != w.Model || ot != tenant {
			continue
		}
		if o.BlockSize > 0 && o.BlockSize != w.BlockSize {
			return &httpError{code: http.StatusConflict, err: fmt.Errorf(
				"%s/%s serves block_size %d (instance %d): a namespace has one block size", w.Model, tenant, o.BlockSize, inst)}
		}
	}
	return nil
}

// instanceOf is the instance and tenant worker id w is in the compatible
// APIs: a /v1 worker (no tenant) is the instance of its own id in the
// default tenant.
func instanceOf(id uint64, w *raftfsm.WorkerInfo) (uint64, string) {
	if w.Tenant == "" {
		return id, DefaultTenant
	}
	return w.Instance, w.Tenant
}

func (x *Indexer) doUnregister(ctx context.Context, req *UnregisterRequest) error {
	if err := x.b.CheckLeader(); err != nil {
		return err
	}
	if err := requireModel(req.ModelName, req.TenantID, req.RoutingGroup); err != nil {
		return err
	}
	tenant := "" // every tenant of the model
	if req.TenantID != "" || req.RoutingGroup != "" {
		t, err := tenantOf(req.TenantID, req.RoutingGroup)
		if err != nil {
			return err
		}
		tenant = t
	}
	x.regMu.Lock()
	defer x.regMu.Unlock()
	var matched []raftfsm.WorkerInfo
	for _, wi := range x.b.WorkerTable() {
		if wi.Instance == req.InstanceID && wi.Model == req.ModelName && wi.Tenant != "" &&
			(tenant == "" || wi.Tenant == tenant) {
			matched = append(matched, wi)
		}
	}
	slices.SortFunc(matched, func(a, b raftfsm.WorkerInfo) int { return cmp.Compare(a.ID, b.ID) })
	found := false
	for _, wi := range matched {
		if req.DPRank == nil {
			found = true
			if err := x.b.DeregisterWorker(ctx, wi.ID); err != nil {
				return fmt.Errorf("unregister instance %d: %w", req.InstanceID, err)
			}
			continue
		}
		dp := *req.DPRank
		if !slices.Contains(wi.DPRanks, dp) {
			continue
		}
		found = true
		if len(wi.DPRanks) <= 1 {
			if err := x.b.DeregisterWorker(ctx, wi.ID); err != nil {
				return fmt.Errorf("unregister instance %d: %w", req.InstanceID, err)
			}
			continue
		}
		nw := wi
		nw.DPRanks = slices.DeleteFunc(slices.Clone(wi.DPRanks), func(r uint32) bool { return r == dp })
		nw.EventEndpoints = maps.Clone(wi.EventEndpoints)
		delete(nw.EventEndpoints, dp)
		nw.ReplayEndpoints = maps.Clone(wi.ReplayEndpoints)
		delete(nw.ReplayEndpoints, dp)
		// The registration without the rank drops the rank's state with it.
		if err := x.b.RegisterWorker(ctx, nw); err != nil {
			return fmt.Errorf("unregister instance %d dp rank %d: %w", req.InstanceID, dp, err)
		}
	}
	if !found {
		what := fmt.Sprintf("instance %d of model %s", req.InstanceID, req.ModelName)
		if tenant != "" {
			what += " tenant " + tenant
		}
		if req.DPRank != nil {
			what += fmt.Sprintf(" dp rank %d", *req.DPRank)
		}
		return &httpError{code: http.StatusNotFound, err: fmt.Errorf("%s is not registered", what)}
	}
	return nil
}

// workers answers GET /workers: every instance registered through the
// compatible APIs, or, as Dynamo's indexer filters, those of the model
// (?model_name=) and the tenant (?tenant_id= or ?routing_group=, its
// alias) given, both narrowing; [] when none matches.
func (x *Indexer) workers(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	model, tid, group := q.Get("model_name"), q.Get("tenant_id"), q.Get("routing_group")
	if err := checkNames(model, tid, group); err != nil {
		return answer(w, codecOf(r), 0, nil, err)
	}
	tenant := "" // every tenant
	if tid != "" || group != "" {
		t, err := tenantOf(tid, group)
		if err != nil {
			return answer(w, codecOf(r), 0, nil, err)
		}
		tenant = t
	}
	byInst := map[uint64]Map[string]{}
	table := x.b.WorkerTable()
	// In id order, the first registration of a rank naming an endpoint
	// gives it: the same answer on every call and every replica.
	for _, id := range slices.Sorted(maps.Keys(table)) {
		wi := table[id]
		if wi.Tenant == "" {
			continue // a /v1 worker has no event endpoints
		}
		if model != "" && wi.Model != model || tenant != "" && wi.Tenant != tenant {
			continue
		}
		eps := byInst[wi.Instance]
		if eps == nil {
			eps = Map[string]{}
			byInst[wi.Instance] = eps
		}
		for dp, ep := range wi.EventEndpoints {
			k := strconv.FormatUint(uint64(dp), 10)
			if _, ok := eps[k]; !ok {
				eps[k] = ep
			}
		}
	}
	out := make([]Instance, 0, len(byInst))
	for _, id := range slices.Sorted(maps.Keys(byInst)) {
		out = append(out, Instance{InstanceID: id, Endpoints: byInst[id]})
	}
	return answer(w, codecOf(r), http.StatusOK, out, nil)
}

func (x *Indexer) query(_ context.Context, req *QueryRequest) (any, error) {
	if err := requireModel(req.ModelName, req.TenantID, req.RoutingGroup); err != nil {
		return nil, err
	}
	if err := checkName("lora_name", req.LoRAName); err != nil {
		return nil, err
	}
	if err := checkName("cache_salt", req.CacheSalt); err != nil {
		return nil, err
	}
	tenant, err := tenantOf(req.TenantID, req.RoutingGroup)
	if err != nil {
		return nil, err
	}
	ns := x.ns.get(x.b, req.ModelName, tenant)
	sc := x.pool.Get().(*queryScratch)
	defer x.pool.Put(sc)
	bs := ns.blockSize
	if bs <= 0 {
		bs = raftfsm.DefaultBlockSize
	}
	sc.local = kvevent.LocalHashes(sc.local[:0], req.TokenIDs, bs, kvevent.SeedFor(req.LoRAName, req.CacheSalt))
	return x.lookup(ns, sc), nil
}

func (x *Indexer) queryByHash(_ context.Context, req *QueryByHashRequest) (any, error) {
	if err := requireModel(req.ModelName, req.TenantID, req.RoutingGroup); err != nil {
		return nil, err
	}
	if req.CacheSalt != nil {
		return nil, &httpError{code: http.StatusBadRequest, err: errHashSalt}
	}
	tenant, err := tenantOf(req.TenantID, req.RoutingGroup)
	if err != nil {
		return nil, err
	}
	return x.lookupHashes(x.ns.get(x.b, req.ModelName, tenant), req.BlockHashes), nil
}

// lookupHashes is lookup of content hashes given on the wire.
func (x *Indexer) lookupHashes(ns *namespace, hs []Hash) QueryResponse {
	sc := x.pool.Get().(*queryScratch)
	defer x.pool.Put(sc)
	sc.local = sc.local[:0]
	for _, h := range hs {
		sc.local = append(sc.local, uint64(h))
	}
	return x.lookup(ns, sc)
}

// lookup scores sc.local against the namespace's ranks. The index walk
// sees every rank; ranks of other namespaces are dropped here.
func (x *Indexer) lookup(ns *namespace, sc *queryScratch) QueryResponse {
	out := QueryResponse{Scores: Map[Map[int]]{}, Frequencies: []int{}, Instances: Map[InstanceOverlap]{}}
	if len(ns.workers) == 0 || len(sc.local) == 0 {
		return out
	}
	bs := ns.blockSize
	x.b.FindMatches(sc.local, indexer.ViewTiered, &sc.matches)
	for _, m := range sc.matches.Ranks {
		wi, ok := ns.has(m.Rank)
		if !ok {
			continue
		}
		total := int(m.Total())
		if total == 0 {
			continue
		}
		for len(out.Frequencies) < total {
			out.Frequencies = append(out.Frequencies, 0)
		}
		for d := 0; d < total; d++ {
			out.Frequencies[d]++
		}
		inst := strconv.FormatUint(wi.Instance, 10)
		dp := strconv.FormatUint(uint64(m.Rank.DP), 10)
		s := out.Scores[inst]
		if s == nil {
			s = Map[int]{}
			out.Scores[inst] = s
		}
		// A rank's score is its device run, as Dynamo defines scores and
		// dp ("each instance's per-dp_rank gpu count"): a client that
		// routes by them must not take a prefix held only on host or
		// disk for one on the GPU. Host and disk are in cpu and disk.
		gpu := int(m.Blocks[kvevent.TierDevice])
		s[dp] = gpu * bs
		o, ok := out.Instances[inst]
		if !ok {
			o.DP = Map[int]{}
		}
		o.DP[dp] = gpu * bs
		cpu := gpu + int(m.Blocks[kvevent.TierHostPinned])
		disk := cpu + int(m.Blocks[kvevent.TierDisk])
		o.GPU = max(o.GPU, gpu*bs)
		o.CPU = max(o.CPU, cpu*bs)
		o.Disk = max(o.Disk, disk*bs)
		o.LongestMatched = max(o.LongestMatched, total*bs)
		out.Instances[inst] = o
	}
	return out
}

// resolve finds the worker an events request is for: (instance, model,
// tenant) when the model is named, else the instance's only registration.
func (x *Indexer) resolve(instance uint64, model, tenant string) (*raftfsm.WorkerInfo, error) {
	table := x.b.WorkerTable()
	if model != "" {
		t := orDefaultTenant(tenant)
		wi, ok := table[WorkerID(instance, model, t)]
		if ok && (wi.Instance != instance || wi.Model != model || wi.Tenant != t) {
			ok = false // another registration's id (WorkerID is a hash)
		}
		if !ok {
			return nil, &httpError{code: http.StatusNotFound, err: fmt.Errorf(
				"instance %d is not registered for model %s tenant %s", instance, model, t)}
		}
		return &wi, nil
	}
	var found []raftfsm.WorkerInfo
	for _, wi := range table {
		if wi.Tenant != "" && wi.Instance == instance && (tenant == "" || wi.Tenant == tenant) {
			found = append(found, wi)
		}
	}
	switch len(found) {
	case 0:
		return nil, &httpError{code: http.StatusNotFound, err: fmt.Errorf("instance %d is not registered", instance)}
	case 1:
		return &found[0], nil
	}
	return nil, badRequest("instance %d is registered for %d (model, tenant) pairs: name model_name and tenant_id", instance, len(found))
}

// doEvents applies posted events through each rank's cursor. An agentless
// (positional) instance's are refused: its engine's stream is followed by
// the leader.
func (x *Indexer) doEvents(ctx context.Context, req *EventsRequest) (EventsResponse, error) {
	if err := x.b.CheckLeader(); err != nil {
		return EventsResponse{}, err
	}
	if err := checkNames(req.ModelName, req.TenantID, req.RoutingGroup); err != nil {
		return EventsResponse{}, err
	}
	tenant := "" // the instance's only registration, when no model is named
	if req.TenantID != "" || req.RoutingGroup != "" {
		t, err := tenantOf(req.TenantID, req.RoutingGroup)
		if err != nil {
			return EventsResponse{}, err
		}
		tenant = t
	}
	wi, err := x.resolve(req.InstanceID, req.ModelName, tenant)
	if err != nil {
		return EventsResponse{}, err
	}
	if req.BlockSize != 0 && req.BlockSize != wi.BlockSize {
		return EventsResponse{}, badRequest("block_size %d: instance %d is registered with %d", req.BlockSize, req.InstanceID, wi.BlockSize)
	}
	if wi.Positional {
		// Its cursor holds positions in the engine's stream, which the
		// leader's subscriber commits: a posted id past them would leave
		// the subscriber nothing it could commit.
		return EventsResponse{}, &httpError{code: http.StatusConflict, err: fmt.Errorf(
			"instance %d of %s/%s is agentless: its events come from its engine, which the cluster follows; "+
				"to post its events instead, unregister it and register it with \"agentless\": false", req.InstanceID, wi.Model, wi.Tenant)}
	}
	ns := namespace{workers: map[uint64]*raftfsm.WorkerInfo{wi.ID: wi}}
	var batches []raftfsm.RankBatch
	at := map[uint32]int{} // dp rank → its batch
	for i := range req.Events {
		e := &req.Events[i]
		if e.InstanceID != nil && *e.InstanceID != req.InstanceID {
			// An event's instance_id (GET /dump writes one) names its
			// instance: applied to the body's, a dump of several
			// instances posted whole merged them into one.
			return EventsResponse{}, badRequest("event %d: instance_id %d, in a post of instance %d's events", i, *e.InstanceID, req.InstanceID)
		}
		rank := kvevent.Rank{Worker: wi.ID, DP: e.DPRank}
		if _, ok := ns.has(rank); !ok {
			return EventsResponse{}, badRequest("event %d: dp rank %d of instance %d is not registered", i, e.DPRank, req.InstanceID)
		}
		ev, err := e.toEvent(rank)
		if err != nil {
			return EventsResponse{}, badRequest("event %d: %v", i, err)
		}
		j, ok := at[e.DPRank]
		if !ok {
			j = len(batches)
			at[e.DPRank] = j
			batches = append(batches, raftfsm.RankBatch{Rank: rank})
		}
		batches[j].Events = append(batches[j].Events, ev)
	}
	resp := EventsResponse{Status: "ok", Acks: []EventAck{}}
	if len(batches) == 0 {
		return resp, nil
	}
	acks, err := x.b.IngestEvents(ctx, batches)
	if err != nil {
		return resp, fmt.Errorf("events of instance %d: %w", req.InstanceID, err)
	}
	for _, a := range acks {
		resp.Acks = append(resp.Acks, EventAck{DPRank: a.Rank.DP, Cursor: a.Cursor, Applied: a.Applied,
			Duplicates: a.Dups, Gap: a.Gap, Resync: a.Resync})
	}
	return resp, nil
}

// toEvent converts a wire event of rank r; the result owns its slices.
func (e *Event) toEvent(r kvevent.Rank) (kvevent.Event, error) {
	ev := kvevent.Event{Rank: r, EventID: e.EventID}
	if e.EventID == 0 {
		return ev, errors.New("event_id 0: ids start at 1")
	}
	tier := kvevent.TierDevice
	if e.Medium != "" {
		t, err := kvevent.ParseMedium(e.Medium)
		if err != nil {
			return ev, err
		}
		tier = t
	}
	ev.Tier = tier
	switch strings.ToLower(e.Type) {
	case typeStored:
		ev.Kind = kvevent.KindStored
		if e.ParentHash != nil {
			ev.HasParent, ev.Parent = true, uint64(*e.ParentHash)
		}
		ev.Blocks = make([]kvevent.Block, len(e.Blocks))
		for i, b := range e.Blocks {
			ev.Blocks[i] = kvevent.Block{EngineHash: uint64(b.BlockHash), LocalHash: uint64(b.TokensHash)}
		}
	case typeRemoved:
		ev.Kind = kvevent.KindRemoved
		ev.Removed = make([]uint64, len(e.BlockHashes))
		for i, h := range e.BlockHashes {
			ev.Removed[i] = uint64(h)
		}
	case typeCleared:
		ev.Kind = kvevent.KindCleared
	default:
		return ev, fmt.Errorf("type %q: want stored, removed or cleared", e.Type)
	}
	if err := ev.Validate(); err != nil {
		return ev, err
	}
	return ev, nil
}

// mediumOf is each tier's medium on the wire.
var mediumOf = [kvevent.NumTiers]string{"GPU", "CPU", "DISK", "EXTERNAL"}

// eventOf is the wire form of a stored event of the dump.
func eventOf(instance uint64, ev *kvevent.Event) Event {
	inst := instance
	out := Event{InstanceID: &inst, DPRank: ev.Rank.DP, EventID: ev.EventID, Type: typeStored,
		Medium: mediumOf[ev.Tier], Blocks: make([]Block, len(ev.Blocks))}
	if ev.HasParent {
		p := Hash(ev.Parent)
		out.ParentHash = &p
	}
	for i, b := range ev.Blocks {
		out.Blocks[i] = Block{BlockHash: Hash(b.EngineHash), TokensHash: Hash(b.LocalHash)}
	}
	return out
}

// dumpModel escapes a model name for dumpKey.
var dumpModel = strings.NewReplacer("%", "%25", ":", "%3A")

// dumpKey is a namespace's key in GET /dump: "<model>:<tenant>", which the
// standard API's peers read back by splitting it at its first ':'. A
// model's ':' (llama3:8b) and '%' are written %3A and %25, so that the
// first ':' is the separator and two namespaces never share a key:
// ("a:b", "c") is "a%3Ab:c", ("a", "b:c") "a:b:c". A key of a model with
// neither keeps its plain form.
func dumpKey(model, tenant string) string {
	return dumpModel.Replace(model) + ":" + tenant
}

func (x *Indexer) dump(w http.ResponseWriter, r *http.Request) error {
	out := Map[*DumpNamespace]{}
	table := x.b.WorkerTable()
	for _, id := range slices.Sorted(maps.Keys(table)) {
		wi := table[id]
		if wi.Tenant == "" {
			wi.Tenant, wi.Instance = DefaultTenant, id
		}
		key := dumpKey(wi.Model, wi.Tenant)
		ns := out[key]
		if ns == nil {
			ns = &DumpNamespace{BlockSize: wi.BlockSize, Events: []Event{}}
			out[key] = ns
		}
		ranks := wi.DPRanks
		if len(ranks) == 0 {
			ranks = []uint32{0}
		}
		for _, dp := range ranks {
			d, err := x.b.DumpRank(kvevent.Rank{Worker: id, DP: dp})
			if errors.Is(err, indexer.ErrUnknownRank) {
				continue
			}
			if err != nil {
				return answer(w, codecOf(r), 0, nil, fmt.Errorf("dump instance %d dp rank %d: %w", wi.Instance, dp, err))
			}
			evs := d.StoredEvents()
			for i := range evs {
				ns.Events = append(ns.Events, eventOf(wi.Instance, &evs[i]))
			}
		}
	}
	return answer(w, codecOf(r), http.StatusOK, out, nil)
}

func (x *Indexer) health(w http.ResponseWriter, r *http.Request) error {
	st := x.b.Status()
	if !st.Ready {
		return answer(w, codecOf(r), http.StatusServiceUnavailable,
			Map[string]{"status": "not ready", "state": st.State}, nil)
	}
	return answer(w, codecOf(r), http.StatusOK, Map[string]{"status": "ok", "state": st.State}, nil)
}
