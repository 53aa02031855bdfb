package raftfsm

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// fsmModel is the reference of the FSM's own rules (the index has its own
// model): per-rank cursors with duplicate and gap handling, the worker set,
// and which bookings are live.
type fsmModel struct {
	cursors map[kvevent.Rank]uint64
	workers map[uint64]bool
	live    map[string]kvevent.Rank
	freed   map[string]bool
}

// fsmRanks are the ranks the generated commands name.
var fsmRanks = []kvevent.Rank{{Worker: 1}, {Worker: 1, DP: 1}, {Worker: 2}}

func genFSMCommand(t *rapid.T, m *fsmModel) []byte {
	ranks := fsmRanks
	switch rapid.IntRange(0, 10).Draw(t, "cmd") {
	case 0, 1, 2, 3, 4:
		var batches []RankBatch
		for _, r := range rapid.SliceOfNDistinct(rapid.SampledFrom(ranks), 1, 3, func(r kvevent.Rank) kvevent.Rank { return r }).Draw(t, "ranks") {
			// Start near the cursor: duplicates, the next id, or a gap.
			first := m.cursors[r] + 1 + uint64(rapid.IntRange(-2, 1).Draw(t, "offset"))
			if int64(first) < 1 {
				first = 1
			}
			n := rapid.IntRange(1, 4).Draw(t, "n")
			batches = append(batches, RankBatch{Rank: r, Events: chainEvents(r, first, n, first*7)})
		}
		for _, b := range batches {
			cur := m.cursors[b.Rank]
			for _, ev := range b.Events {
				if ev.EventID <= cur {
					continue
				}
				if ev.EventID != cur+1 {
					break
				}
				cur++
			}
			m.cursors[b.Rank] = cur
		}
		return encodeEvents(5, batches)
	case 5:
		id := uint64(rapid.IntRange(1, 2).Draw(t, "worker"))
		m.workers[id] = true
		return encodeRegister(5, &WorkerInfo{ID: id, DPRanks: []uint32{0, 1}, BlockSize: 16, Capacity: [4]int64{64}})
	case 6:
		id := uint64(rapid.IntRange(1, 2).Draw(t, "worker"))
		delete(m.workers, id)
		for r := range m.cursors {
			if r.Worker == id {
				delete(m.cursors, r)
			}
		}
		for rid, r := range m.live {
			if r.Worker == id {
				delete(m.live, rid)
				m.freed[rid] = true
			}
		}
		return encodeDeregister(5, id)
	case 7:
		rid := rapid.SampledFrom([]string{"a", "b", "c"}).Draw(t, "request")
		r := rapid.SampledFrom(ranks).Draw(t, "rank")
		// A rank no registered worker has books nothing (its worker left
		// between the route's decision and the commit).
		if _, ok := m.live[rid]; !ok && !m.freed[rid] && m.workers[r.Worker] {
			m.live[rid] = r
		}
		return encodeBook(5, []bookOp{{kind: bookAdd, b: Booking{ID: rid, Rank: r, SeqHashes: []uint64{1, 2}, ISL: 32}}})
	case 8:
		// An output block with a decay weight: the booking's discount must
		// survive a reopen and a snapshot like the rest of it.
		rid := rapid.SampledFrom([]string{"a", "b", "c"}).Draw(t, "request")
		ops := []bookOp{{kind: bookOutput, b: Booking{ID: rid, SeqHashes: []uint64{rapid.Uint64Range(1, 4).Draw(t, "output hash")}}}}
		if rapid.Bool().Draw(t, "decay") {
			ops = append(ops, bookOp{kind: bookDecay, b: Booking{ID: rid, Discount: uint32(rapid.IntRange(0, 4).Draw(t, "quarters")) * indexer.DecayScale / 4}})
		}
		return encodeBook(5, ops)
	default:
		rid := rapid.SampledFrom([]string{"a", "b", "c"}).Draw(t, "request")
		if _, ok := m.live[rid]; ok {
			delete(m.live, rid)
			m.freed[rid] = true
		}
		return encodeBook(5, []bookOp{{kind: bookFree, b: Booking{ID: rid}}})
	}
}

// TestFSMMatchesModelAndSurvivesReopenAndSnapshot applies random commands
// in random batches, then checks the FSM against the model, and that a
// reopen and a snapshot/restore both give the same digest.
func TestFSMMatchesModelAndSurvivesReopenAndSnapshot(t *testing.T) {
	rounds := 1
	if os.Getenv("KVROUTER_LONG") != "" {
		rounds = 20 // make test-long
	}
	for range rounds {
		checkFSMMatchesModel(t)
	}
}

func checkFSMMatchesModel(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		dir := filepath.Join(t.TempDir(), "fsm")
		f, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet, OnFatal: func(err error) { rt.Fatalf("fatal: %v", err) }})
		if err != nil {
			rt.Fatal(err)
		}
		m := &fsmModel{cursors: map[kvevent.Rank]uint64{}, workers: map[uint64]bool{}, live: map[string]kvevent.Rank{}, freed: map[string]bool{}}
		var w logWriter
		var pending []*raft.Log
		for i, n := 0, rapid.IntRange(1, 40).Draw(rt, "commands"); i < n; i++ {
			pending = append(pending, w.next(genFSMCommand(rt, m)))
			if rapid.Bool().Draw(rt, "flush") {
				f.ApplyBatch(pending)
				pending = nil
			}
		}
		f.ApplyBatch(pending)
		// Every rank the commands name, so that a cursor the FSM kept
		// and the model dropped (a worker's removal) is compared too.
		for _, r := range fsmRanks {
			if got, c := f.Cursor(r), m.cursors[r]; got != c {
				rt.Fatalf("cursor of %v = %d, model %d", r, got, c)
			}
		}
		if len(f.Workers()) != len(m.workers) {
			rt.Fatalf("workers %v, model %v", f.Workers(), m.workers)
		}
		live, _ := f.Sequences().Count()
		if live != len(m.live) {
			rt.Fatalf("live bookings %d, model %d", live, len(m.live))
		}
		d := f.Digest()
		if !rapid.Bool().Draw(rt, "checkDurability") {
			f.Close() // durability round trips cost a few Pebble opens: check half the runs
			return
		}
		saved := viewBytes(t, f) // a user's save: the open group laid over the database
		snap := snapshotBytes(t, f)
		if !bytes.Equal(saved, snap) {
			rt.Fatal("a save's stream differs from Raft's snapshot of the same state")
		}
		if err := f.db.Sync(); err != nil {
			rt.Fatal(err)
		}
		f.Close()
		g, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet, OnFatal: func(err error) { rt.Fatalf("fatal: %v", err) }})
		if err != nil {
			rt.Fatal(err)
		}
		defer g.Close()
		if g.Digest() != d {
			rt.Fatalf("reopened digest %#x, want %#x", g.Digest(), d)
		}
		h, err := OpenFSM(FSMConfig{Dir: filepath.Join(t.TempDir(), "fsm"), Logger: quiet, OnFatal: func(err error) { rt.Fatalf("fatal: %v", err) }})
		if err != nil {
			rt.Fatal(err)
		}
		defer h.Close()
		if err := h.Restore(nopCloser{bytes.NewReader(snap)}); err != nil {
			rt.Fatal(err)
		}
		if h.Digest() != d {
			rt.Fatalf("restored digest %#x, want %#x", h.Digest(), d)
		}
	})
}
