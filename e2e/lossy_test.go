package e2e

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/netproxy"
)

// lossyFor is how long TestLossyRaftLinksLoseNothingAcknowledged keeps
// every Raft link lossy: several election timeouts (200 ms), short enough
// for the test to run in make test.
const lossyFor = 3 * time.Second

// lossy puts every link in the lossy mode f, each with a seed of its own
// drawn from f.Seed, or takes the faults off every link when f is zero.
func (h *raftHub) lossy(f netproxy.Faults) {
	h.c.t.Helper()
	seed := f.Seed
	for i, row := range h.links {
		for j, p := range row {
			if p == nil {
				continue
			}
			lf := f
			if f != (netproxy.Faults{}) {
				lf.Seed = seed + uint64(i*len(row)+j)
			}
			if err := p.SetFaults(lf); err != nil {
				h.c.t.Fatal(err)
			}
		}
	}
	if f == (netproxy.Faults{}) {
		h.c.t.Logf("took the faults off every link")
	} else {
		h.c.t.Logf("every link lossy: %v (link i->j seeded %d + i*%d + j)", f, seed, len(h.links))
	}
}

// resets is how many connections the faults reset, per link.
func (h *raftHub) resets() string {
	var out []string
	for i, row := range h.links {
		for j, p := range row {
			if p != nil {
				st := p.Stats()
				out = append(out, fmt.Sprintf("%s %d of %d", h.linkName(i, j), st.Reset, st.Forwarded))
			}
		}
	}
	return strings.Join(out, ", ")
}

// TestLossyRaftLinksLoseNothingAcknowledged is fault scenario 10: two
// publishers stream event batches through every node (retrying what was
// not acknowledged, on the next node) while every Raft link of the
// cluster loses about half its traffic and delays the rest by a jittered
// delay, for a few seconds. On TCP a loss is a reset connection
// (netproxy.Faults): every other chunk, either way, kills its connection
// with what was in flight, and Raft dials again and sends again. Whatever
// the cluster acknowledges meanwhile, or fails to, once the links are
// clean again a leader serves, the stream goes on, and every node holds
// exactly what was acknowledged, at one applied index with one digest,
// each event applied once.
func TestLossyRaftLinksLoseNothingAcknowledged(t *testing.T) {
	seed := testSeed(t)
	c, h := startPartitionedCluster(t, 3)
	pubs, all := registeredPublishers(t, c.cl, seed)

	s := newStream(t, ctxT(t, 2*convergeTimeout))
	s.publish(c, pubs)
	s.ackedAtLeast(c, 20, "20 requests acknowledged before the links turn lossy")

	before := c.statusAll()
	atLossy := s.acked.Load()
	h.lossy(netproxy.Faults{Delay: time.Millisecond, Jitter: 20 * time.Millisecond, ResetProb: 0.5, Seed: seed})
	// The fault's duration, not a wait for a condition: what the cluster
	// does meanwhile (elections, acknowledgements or none) is timing's.
	time.Sleep(lossyFor)
	during := c.statusAll()
	atClean := s.acked.Load()
	t.Logf("lossy for %v: %d requests acknowledged meanwhile; connections reset per link: %s", lossyFor, atClean-atLossy, h.resets())
	t.Logf("before: %s", describe(before))
	t.Logf("at the end of the faults: %s", describe(during))
	h.lossy(netproxy.Faults{})

	lead := c.leader()
	s.ackedAtLeast(c, atClean+20, "20 requests acknowledged after the links are clean")
	s.wait(t)

	retries, dups := totals(pubs)
	t.Logf("leader %s after the faults; %d requests acknowledged in all; %d requests retried, %d events acknowledged as duplicates",
		c.nodes[lead].id, s.acked.Load(), retries, dups)
	var reset uint64
	for _, row := range h.links {
		for _, p := range row {
			if p != nil {
				reset += p.Stats().Reset
			}
		}
	}
	if reset == 0 {
		t.Fatal("the faults reset no connection: the links were not lossy")
	}
	c.converged()
	c.checkAll(all)
	c.statusAgrees()
	// No node restarted, and none was sent a snapshot (the log is short):
	// each applied every acknowledged event once.
	c.appliedOnce(all)
}
