package compat

import (
	"context"
	"encoding/binary"
	"net/http"
	"reflect"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
	"github.com/zeebo/xxh3"
)

// Backend is the node the compatible APIs read and write. *raftfsm.Node
// implements it.
type Backend interface {
	// Status is this node's view of itself and the cluster. It never blocks.
	Status() raftfsm.NodeStatus
	// CheckLeader returns nil on the leader, else the error a write would
	// return (wrapping raftfsm.ErrNotLeader, naming the leader when known).
	// A write handler calls it before validating against the replicated
	// state, so that the leader's state, not a follower's stale one,
	// judges the write.
	CheckLeader() error
	// WorkerTable returns the replicated worker registrations by worker
	// id. The map is shared: read it, never change it. It never blocks.
	WorkerTable() map[uint64]raftfsm.WorkerInfo
	// RegisterWorker registers a worker or replaces its registration
	// (through Raft; raftfsm.ErrNotLeader on a follower). Ranks the new
	// registration drops lose their index state, bookings and cursor.
	RegisterWorker(ctx context.Context, w raftfsm.WorkerInfo) error
	// DeregisterWorker removes a worker, its ranks' index state and load;
	// raftfsm.ErrUnknownWorker when there is none of that id.
	DeregisterWorker(ctx context.Context, workerID uint64) error
	// IngestEvents applies each rank's batch through its cursor and
	// acknowledges each once committed, in the order of batches.
	IngestEvents(ctx context.Context, batches []raftfsm.RankBatch) ([]raftfsm.RankAck, error)
	// FindMatches looks content hashes up in this node's index.
	FindMatches(local []uint64, view indexer.View, out *indexer.Matches)
	// DumpRank returns a copy of one rank's index state;
	// indexer.ErrUnknownRank when the index holds nothing of it.
	DumpRank(r kvevent.Rank) (indexer.RankDump, error)
}

var _ Backend = (*raftfsm.Node)(nil)

// Router is where the APIs register their routes: *api.Server, whose
// middleware gives them metrics, body limits and forwarding to the leader.
type Router interface {
	HandleFunc(pattern string, h func(w http.ResponseWriter, r *http.Request) error)
	// HandleFuncOnce registers a write not safe to apply twice: one whose
	// node lost its leadership (or closed) with the write in its log is
	// answered 503 no_leader (shutting_down) with X-Kvrouter-Maybe-Applied, not forwarded to the new
	// leader, where it would apply a second time.
	HandleFuncOnce(pattern string, h func(w http.ResponseWriter, r *http.Request) error)
	// CheckWorkers adds a check of every /v1 worker registration, run under
	// the worker-table lock before it is proposed; an error wrapping
	// api.ErrConflict refuses it with a 409. The namespace rules hold
	// for /v1 workers too: they are in the compatible APIs' namespaces.
	CheckWorkers(check func(w raftfsm.WorkerInfo) error)
	// HandleErrors lets the APIs write the errors the Router answers for a
	// request under prefix (a missing token's 401, no route's 404 or 405,
	// a body past its limit, a 503 without a leader, their handlers'
	// errors; write returns false to leave it to the Router's JSON
	// error): in the request's encoding.
	HandleErrors(prefix string, write func(w http.ResponseWriter, r *http.Request, code int, msg string) bool)
}

// DefaultTenant is the tenant of a request that names none.
const DefaultTenant = "default"

// WorkerID is the kvrouter worker id of an instance registered for a
// (model, tenant): an instance in two tenants is two workers, so that a
// tenant's state is its own. The top bit is set, keeping these ids apart
// from the small ids operators give /v1 workers.
func WorkerID(instance uint64, model, tenant string) uint64 {
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], instance)
	h := xxh3.New()
	h.Write(b[:])
	h.WriteString(model)
	h.Write([]byte{0})
	h.WriteString(tenant)
	return h.Sum64() | 1<<63
}

// namespace is one (model, tenant) pair's workers, from the worker table.
type namespace struct {
	model, tenant string
	blockSize     int
	workers       map[uint64]*raftfsm.WorkerInfo // by kvrouter worker id
}

// namespaceOf collects the workers of (model, tenant). blockSize is the
// smallest worker id's (workers of one model agree), or 0 when none.
func namespaceOf(table map[uint64]raftfsm.WorkerInfo, model, tenant string) namespace {
	ns := namespace{model: model, tenant: tenant, workers: map[uint64]*raftfsm.WorkerInfo{}}
	first := ^uint64(0)
	for id := range table {
		w := table[id]
		if w.Tenant == "" {
			// A /v1 worker: the instance of its own id, in the default tenant.
			w.Tenant, w.Instance = DefaultTenant, id
		}
		if w.Model != model || w.Tenant != tenant {
			continue
		}
		ns.workers[id] = &w
		if id < first {
			ns.blockSize, first = w.BlockSize, id
		}
	}
	return ns
}

// has reports whether the namespace serves rank r.
func (ns *namespace) has(r kvevent.Rank) (*raftfsm.WorkerInfo, bool) {
	w := ns.workers[r.Worker]
	if w == nil {
		return nil, false
	}
	if len(w.DPRanks) == 0 {
		return w, r.DP == 0
	}
	for _, dp := range w.DPRanks {
		if dp == r.DP {
			return w, true
		}
	}
	return nil, false
}

// maxCachedNamespaces bounds the namespace cache: queries name models and
// tenants freely, and a name nobody registered still gets an entry.
const maxCachedNamespaces = 1024

// nsCache holds the namespaces built from one worker table. The table is
// copy-on-write (a registration publishes a new map), so the map's
// identity says when the cache is stale.
type nsCache struct {
	table unsafe.Pointer
	mu    sync.Mutex
	byKey map[[2]string]*namespace
}

// namespaces returns the namespace of (model, tenant) from the current
// worker table, built once per table. The result is shared: read it only.
type namespaces struct {
	cur atomic.Pointer[nsCache]
}

func (c *namespaces) get(b Backend, model, tenant string) *namespace {
	table := b.WorkerTable()
	id := reflect.ValueOf(table).UnsafePointer()
	nc := c.cur.Load()
	if nc == nil || nc.table != id {
		nc = &nsCache{table: id, byKey: map[[2]string]*namespace{}}
		c.cur.Store(nc)
	}
	k := [2]string{model, tenant}
	nc.mu.Lock()
	defer nc.mu.Unlock()
	ns := nc.byKey[k]
	if ns == nil {
		if len(nc.byKey) >= maxCachedNamespaces {
			clear(nc.byKey)
		}
		n := namespaceOf(table, model, tenant)
		ns = &n
		nc.byKey[k] = ns
	}
	return ns
}
