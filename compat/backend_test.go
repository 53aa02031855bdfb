package compat

import (
	"strconv"
	"testing"

	"github.com/kvrouter/kvrouter/raftfsm"
)

// tableBackend is a Backend whose worker table is table; it serves
// nothing else.
type tableBackend struct {
	Backend
	table map[uint64]raftfsm.WorkerInfo
}

func (b tableBackend) WorkerTable() map[uint64]raftfsm.WorkerInfo { return b.table }

// TestNamespaceCacheStaysBounded: queries name models and tenants freely,
// and a name nobody registered still gets a namespace, so the cache of one
// worker table holds at most maxCachedNamespaces of them, however many
// distinct (model, tenant) pairs were asked for; a namespace built after
// the cache was emptied is still the table's.
func TestNamespaceCacheStaysBounded(t *testing.T) {
	b := tableBackend{table: map[uint64]raftfsm.WorkerInfo{
		7: {Model: "llama", Tenant: DefaultTenant, Instance: 7, BlockSize: 16},
	}}
	var c namespaces
	for i := range 3 * maxCachedNamespaces {
		c.get(b, "model-"+strconv.Itoa(i), "tenant-"+strconv.Itoa(i%7))
		if got := len(c.cur.Load().byKey); got > maxCachedNamespaces {
			t.Fatalf("%d namespaces cached after queries of %d distinct (model, tenant) pairs, want %d at most",
				got, i+1, maxCachedNamespaces)
		}
	}
	ns := c.get(b, "llama", DefaultTenant)
	if _, ok := ns.workers[7]; !ok || ns.blockSize != 16 {
		t.Fatalf("namespace of llama after the cache filled: workers %v, block size %d, want worker 7 of block size 16",
			ns.workers, ns.blockSize)
	}
}
