package benchcluster

import (
	"log/slog"
	"math/rand/v2"
	"net"
	"testing"

	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/raftfsm"
)

var quiet = slog.New(slog.DiscardHandler)

// freeAddr returns a loopback address whose port was free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

func mix(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	return x ^ x>>31
}

// The workload is raftfsm's bench workload (see raftfsm/bench_test.go):
// per rank, chains of Stored events of blocksPerEvent blocks, device tier;
// each sequence is one of 100 family prefixes shared by every rank (16–128
// blocks) plus a private suffix (8–64 blocks), and a rank that already
// holds a family's prefix stores only the suffix, parented on it.

const blocksPerEvent = 8

type genRank struct {
	rank      kvevent.Rank
	salt      uint64
	nextID    uint64
	held      []bool
	queue     []kvevent.Block
	hasParent bool
	parent    uint64
}

type gen struct {
	rng      *rand.Rand
	families [][]uint64
	ranks    []*genRank
	fresh    uint64
	// samples are the local hashes of some whole sequences stored (every
	// sampleEvery-th), for route queries that hit the index.
	samples     [][]uint64
	sampleEvery int
	seqs        int
}

func newGen(seed, stream uint64, ranks []kvevent.Rank) *gen {
	frng := rand.New(rand.NewPCG(seed, 0xfa111e5))
	g := &gen{rng: rand.New(rand.NewPCG(seed, stream)), sampleEvery: 8}
	next := uint64(1)
	for f := 0; f < 100; f++ {
		var fam []uint64
		for n := blocksPerEvent * (2 + frng.IntN(15)); n > 0; n-- {
			fam = append(fam, mix(next^0x5eedfa))
			next++
		}
		g.families = append(g.families, fam)
	}
	for _, r := range ranks {
		g.ranks = append(g.ranks, &genRank{rank: r, salt: mix(r.Worker<<32 ^ uint64(r.DP) ^ 0x7a1), nextID: 1,
			held: make([]bool, len(g.families))})
	}
	return g
}

func (g *gen) newSeq(r *genRank) {
	f := g.rng.IntN(len(g.families))
	fam := g.families[f]
	eng := func(local uint64) uint64 { return mix(r.salt ^ local) }
	suffix := blocksPerEvent * (1 + g.rng.IntN(8))
	q := make([]kvevent.Block, 0, len(fam)+suffix)
	if r.held[f] {
		r.hasParent, r.parent = true, eng(fam[len(fam)-1])
	} else {
		r.hasParent, r.parent = false, 0
		for _, h := range fam {
			q = append(q, kvevent.Block{EngineHash: eng(h), LocalHash: h})
		}
		r.held[f] = true
	}
	var local []uint64
	sample := g.seqs%g.sampleEvery == 0
	g.seqs++
	if sample {
		local = append(local, fam...)
	}
	for i := 0; i < suffix; i++ {
		g.fresh++
		h := mix(r.salt ^ mix(g.fresh))
		q = append(q, kvevent.Block{EngineHash: eng(h), LocalHash: h})
		if sample {
			local = append(local, h)
		}
	}
	if sample {
		g.samples = append(g.samples, local)
	}
	r.queue = q
}

func (g *gen) event(r *genRank) kvevent.Event {
	if len(r.queue) == 0 {
		g.newSeq(r)
	}
	n := min(blocksPerEvent, len(r.queue))
	blocks := r.queue[:n:n]
	r.queue = r.queue[n:]
	ev := kvevent.Event{Rank: r.rank, EventID: r.nextID, Kind: kvevent.KindStored, Tier: kvevent.TierDevice,
		HasParent: r.hasParent, Parent: r.parent, Blocks: blocks}
	r.nextID++
	r.hasParent, r.parent = true, blocks[n-1].EngineHash
	return ev
}

// call returns one batch of perRank events for every rank.
func (g *gen) call(perRank int) []raftfsm.RankBatch {
	out := make([]raftfsm.RankBatch, len(g.ranks))
	for i, r := range g.ranks {
		out[i].Rank = r.rank
		out[i].Events = make([]kvevent.Event, perRank)
		for j := range out[i].Events {
			out[i].Events[j] = g.event(r)
		}
	}
	return out
}
