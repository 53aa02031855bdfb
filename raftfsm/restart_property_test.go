package raftfsm

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"pgregory.net/rapid"
)

// genRestartCommand draws commands of every type, with what the model's
// generator (genFSMCommand) leaves out: the leader's time moving (back
// too), expiry sweeps, stores whose parent the rank lacks (orphans),
// removes, clears, malformed events (a block its own parent), settings
// and members. No model: the test compares two FSMs applying the same
// log. (A tier this build does not know halts the FSM: a later build's
// entry, TestAnEventKindOrTierOfALaterBuildHaltsTheFSM.)
func genRestartCommand(t *rapid.T, now int64) []byte {
	r := rapid.SampledFrom(fsmRanks).Draw(t, "rank")
	switch rapid.IntRange(0, 12).Draw(t, "cmd") {
	case 0, 1, 2:
		first := uint64(rapid.IntRange(1, 12).Draw(t, "first"))
		var evs []kvevent.Event
		for i := 0; i < rapid.IntRange(1, 3).Draw(t, "n"); i++ {
			ev := kvevent.Event{Rank: r, EventID: first + uint64(i), Tier: kvevent.Tier(rapid.IntRange(0, kvevent.NumTiers-1).Draw(t, "tier"))}
			switch rapid.IntRange(0, 4).Draw(t, "kind") {
			case 0, 1, 2:
				ev.Kind = kvevent.KindStored
				ev.HasParent = rapid.Bool().Draw(t, "hasParent")
				if ev.HasParent {
					ev.Parent = uint64(rapid.IntRange(1, 8).Draw(t, "parent"))
				}
				ev.Blocks = []kvevent.Block{{EngineHash: uint64(rapid.IntRange(1, 8).Draw(t, "eh")), LocalHash: uint64(rapid.IntRange(1, 8).Draw(t, "lh"))}}
			case 3:
				ev.Kind = kvevent.KindRemoved
				ev.Removed = []uint64{uint64(rapid.IntRange(1, 8).Draw(t, "rm"))}
			default:
				ev.Kind = kvevent.KindCleared
			}
			evs = append(evs, ev)
		}
		return encodeEvents(now, []RankBatch{{Rank: r, Incarnation: uint64(rapid.IntRange(0, 2).Draw(t, "inc")), Events: evs}})
	case 3:
		w := WorkerInfo{ID: r.Worker, DPRanks: rapid.SampledFrom([][]uint32{{0, 1}, {0}, {1}}).Draw(t, "dps"), BlockSize: 16,
			Capacity: [4]int64{int64(rapid.IntRange(1, 4).Draw(t, "cap"))}, Positional: rapid.Bool().Draw(t, "pos")}
		return encodeRegister(now, &w)
	case 4:
		return encodeDeregister(now, r.Worker)
	case 5:
		return encodeExpire(now, int64(rapid.IntRange(-1, 20).Draw(t, "maxAge")))
	case 6:
		rid := rapid.SampledFrom(fsmRequests).Draw(t, "rid")
		return encodeBook(now, []bookOp{{kind: bookAdd, b: Booking{ID: rid, Rank: r, SeqHashes: []uint64{1, 2}, ISL: 10}}})
	case 7:
		rid := rapid.SampledFrom(fsmRequests).Draw(t, "rid")
		return encodeBook(now, []bookOp{{kind: bookFree, b: Booking{ID: rid}}})
	case 8:
		stored := chainEvents(r, 1, rapid.IntRange(0, 3).Draw(t, "stored"), 1)
		return encodeReplace(now, r, uint64(rapid.IntRange(0, 12).Draw(t, "cursor")), uint64(rapid.IntRange(0, 2).Draw(t, "inc")), stored)
	case 9:
		p := indexer.DefaultParams()
		p.Temperature = float64(rapid.IntRange(0, 3).Draw(t, "temp"))
		return encodeSettings(now, &Settings{Params: p})
	case 10:
		id := rapid.SampledFrom([]string{"n1", "n2"}).Draw(t, "member")
		return encodeMember(now, &Member{ID: id, RaftAddr: id + ":1", HTTPAddr: id + ":2", Voter: rapid.Bool().Draw(t, "voter")})
	case 11:
		return encodeRemoveRanks(now, []kvevent.Rank{r})
	default:
		return encodeMemberGone(now, rapid.SampledFrom([]string{"n1", "n2"}).Draw(t, "member"))
	}
}

// TestReopenMidLogKeepsTheState: one log applied straight through on one
// FSM, and on another that is closed and reopened from its state database
// at random points, or crashed (its open group lost) and given the log
// again as Raft replays it, gives equal responses, digests and state,
// what the digest leaves out (the member table, the orphan and resync
// figures, the settings) included. Small orphan bounds and TTL put the
// orphan buffer's drops and expiries in reach of a short log. rapid
// prints the -rapid.seed that replays a failure; make test-long runs
// more rounds.
func TestReopenMidLogKeepsTheState(t *testing.T) {
	reopenRounds(t, checkReopenMidLogKeepsTheState)
}

// reopenRounds runs a reopen property's check once, and 20 times under
// KVROUTER_LONG (make test-long).
func reopenRounds(t *testing.T, check func(*testing.T)) {
	rounds := 1
	if os.Getenv("KVROUTER_LONG") != "" {
		rounds = 20 // make test-long
	}
	for range rounds {
		check(t)
	}
}

// reopenPair opens the two FSMs a reopen property compares, with a group
// size rapid draws and orphan bounds small enough for short logs: a,
// which applies the log straight, and b in bdir, which the property
// reopens (open) or restores at random points. The caller closes both.
func reopenPair(t *testing.T, rt *rapid.T) (a, b *FSM, bdir string, open func(dir string) *FSM) {
	groupBytes := rapid.SampledFrom([]int{0, 64, 300}).Draw(rt, "group")
	open = func(dir string) *FSM {
		f, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet, GroupBytes: groupBytes, Index: indexer.Config{OrphanTTL: 8, OrphanMaxEvents: 3, OrphanMaxBlocks: 4}, OnFatal: func(err error) { rt.Fatalf("fatal: %v", err) }})
		if err != nil {
			rt.Fatal(err)
		}
		return f
	}
	bdir = filepath.Join(t.TempDir(), "b")
	return open(filepath.Join(t.TempDir(), "a")), open(bdir), bdir, open
}

func checkReopenMidLogKeepsTheState(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		a, b, bdir, open := reopenPair(t, rt)
		defer a.Close()
		defer func() { b.Close() }()
		var w logWriter
		var logs [][]byte
		now := int64(100)
		// Short logs, and a reopen at one entry in five: each Pebble open
		// costs more than the entries, and make test runs this under -race.
		for i, n := 0, rapid.IntRange(1, 20).Draw(rt, "commands"); i < n; i++ {
			now += int64(rapid.IntRange(-3, 6).Draw(rt, "dt"))
			data := genRestartCommand(rt, now)
			logs = append(logs, data)
			l := w.next(data)
			oa := a.ApplyBatch([]*raft.Log{l})[0]
			ob := b.ApplyBatch([]*raft.Log{l})[0]
			if responseString(oa) != responseString(ob) {
				rt.Fatalf("entry %d: response %s straight, %s after reopen", l.Index, responseString(oa), responseString(ob))
			}
			if a.Digest() != b.Digest() {
				rt.Fatalf("entry %d: digest %x straight, %x after reopen", l.Index, a.Digest(), b.Digest())
			}
			switch rapid.IntRange(0, 9).Draw(rt, "reopen") {
			case 0:
				b.Close()
				b = open(bdir)
			case 1:
				// A crash: the open group is lost; Raft replays the log.
				b.dbMu.Lock()
				b.dropGroup()
				b.isClosed = true
				b.ix.Release()
				b.db.Close()
				b.dbMu.Unlock()
				b = open(bdir)
				var replay logWriter
				for replay.index < w.index {
					b.ApplyBatch([]*raft.Log{replay.next(logs[replay.index])})
				}
			default:
				continue
			}
			if sa, sb := fullState(a), fullState(b); sa != sb {
				rt.Fatalf("after entry %d:\nstraight %s\nreopened %s", l.Index, sa, sb)
			}
		}
	})
}

// genEveryCommand adds to genRestartCommand what it leaves out: the
// booking operations other than add and free (prefill done, output
// blocks, decay), several operations in one book command, several ranks
// in one event command, batches of positions, and dumps of stores with
// parents the dump lacks, in several tiers.
func genEveryCommand(t *rapid.T, now int64) []byte {
	r := rapid.SampledFrom(fsmRanks).Draw(t, "rank")
	switch rapid.IntRange(0, 6).Draw(t, "extra") {
	case 6:
		// a dump of random stores: unknown parents, several tiers, chains
		var stored []kvevent.Event
		for i, n := 0, rapid.IntRange(0, 6).Draw(t, "dn"); i < n; i++ {
			ev := kvevent.Event{Rank: r, EventID: uint64(i + 1), Kind: kvevent.KindStored, Tier: kvevent.Tier(rapid.IntRange(0, 3).Draw(t, "dtier"))}
			ev.HasParent = rapid.Bool().Draw(t, "dhp")
			if ev.HasParent {
				ev.Parent = uint64(rapid.IntRange(1, 8).Draw(t, "dparent"))
			}
			for j, k := 0, rapid.IntRange(1, 3).Draw(t, "dk"); j < k; j++ {
				ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: uint64(rapid.IntRange(1, 8).Draw(t, "deh")), LocalHash: uint64(rapid.IntRange(1, 8).Draw(t, "dlh"))})
			}
			stored = append(stored, ev)
		}
		return encodeReplace(now, r, uint64(rapid.IntRange(0, 12).Draw(t, "dcursor")), uint64(rapid.IntRange(0, 2).Draw(t, "dinc")), stored)
	case 0:
		var ops []bookOp
		for i, n := 0, rapid.IntRange(1, 4).Draw(t, "ops"); i < n; i++ {
			rid := rapid.SampledFrom(fsmRequests).Draw(t, "rid")
			switch rapid.IntRange(0, 4).Draw(t, "op") {
			case 0:
				ops = append(ops, bookOp{kind: bookAdd, b: Booking{ID: rid, Rank: rapid.SampledFrom(fsmRanks).Draw(t, "brank"),
					SeqHashes: []uint64{uint64(rapid.IntRange(1, 4).Draw(t, "h1")), uint64(rapid.IntRange(5, 8).Draw(t, "h2"))}, ISL: rapid.IntRange(0, 40).Draw(t, "isl"), CachedTokens: rapid.IntRange(0, 20).Draw(t, "cached")}})
			case 1:
				ops = append(ops, bookOp{kind: bookPrefillDone, b: Booking{ID: rid}})
			case 2:
				ops = append(ops, bookOp{kind: bookOutput, b: Booking{ID: rid, SeqHashes: []uint64{uint64(rapid.IntRange(1, 10).Draw(t, "out"))}}})
			case 3:
				ops = append(ops, bookOp{kind: bookDecay, b: Booking{ID: rid, Discount: uint32(rapid.SampledFrom([]int{0, 1, 500000, indexer.DecayScale}).Draw(t, "disc"))}})
			default:
				ops = append(ops, bookOp{kind: bookFree, b: Booking{ID: rid}})
			}
		}
		return encodeBook(now, ops)
	case 1:
		// positions
		first := uint64(rapid.IntRange(1, 30).Draw(t, "pfirst"))
		evs := chainEvents(r, first, rapid.IntRange(1, 3).Draw(t, "pn"), uint64(rapid.IntRange(1, 5).Draw(t, "pbase")))
		for i := range evs {
			evs[i].EventID = first + uint64(3*i)
		}
		return encodeEvents(now, []RankBatch{{Rank: r, Incarnation: PositionalIncarnation, Events: evs}})
	case 2:
		var bs []RankBatch
		for _, rr := range fsmRanks[:rapid.IntRange(1, 4).Draw(t, "nr")] {
			bs = append(bs, RankBatch{Rank: rr, Incarnation: uint64(rapid.IntRange(0, 2).Draw(t, "minc")),
				Events: chainEvents(rr, uint64(rapid.IntRange(1, 6).Draw(t, "mfirst")), 2, uint64(rapid.IntRange(1, 6).Draw(t, "mbase")))})
		}
		return encodeEvents(now, bs)
	default:
		return genRestartCommand(t, now)
	}
}

// TestReopenMidLogKeepsTheStateForEveryOperation is
// TestReopenMidLogKeepsTheState with every booking operation, multi-rank
// and positional event batches and dumps with unknown parents, entries
// handed to ApplyBatch several at a time, and the second FSM reopened or
// given the first's Raft snapshot (as a follower installs it) at random
// points. rapid prints the -rapid.seed that replays a failure; make
// test-long runs more rounds.
func TestReopenMidLogKeepsTheStateForEveryOperation(t *testing.T) {
	reopenRounds(t, checkReopenMidLogKeepsTheStateForEveryOperation)
}

func checkReopenMidLogKeepsTheStateForEveryOperation(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		a, b, bdir, open := reopenPair(t, rt)
		defer a.Close()
		defer func() { b.Close() }()
		var w logWriter
		now := int64(100)
		// Short logs, and a reopen or a restore at one batch in four:
		// each Pebble open costs more than the entries, and rapid's 100
		// checks take about as long as TestReopenMidLogKeepsTheState's.
		for i, n := 0, rapid.IntRange(1, 20).Draw(rt, "batches"); i < n; i++ {
			var ls []*raft.Log
			for j, k := 0, rapid.IntRange(1, 3).Draw(rt, "batch"); j < k; j++ {
				now += int64(rapid.IntRange(-3, 6).Draw(rt, "dt"))
				ls = append(ls, w.next(genEveryCommand(rt, now)))
			}
			oa := a.ApplyBatch(ls)
			ob := b.ApplyBatch(ls)
			for j := range oa {
				if responseString(oa[j]) != responseString(ob[j]) {
					rt.Fatalf("entry %d: response %s straight, %s after reopen", ls[j].Index, responseString(oa[j]), responseString(ob[j]))
				}
			}
			if a.Digest() != b.Digest() {
				rt.Fatalf("entry %d: digest %x straight, %x after reopen", w.index, a.Digest(), b.Digest())
			}
			switch rapid.IntRange(0, 7).Draw(rt, "reopen") {
			case 0:
				b.Close()
				b = open(bdir)
			case 1:
				// b takes a's Raft snapshot, as a follower installs it
				s, err := a.Snapshot()
				if err != nil {
					rt.Fatal(err)
				}
				var buf bytes.Buffer
				if _, err := writeSnapshot(&buf, s.(*fsmSnapshot).view); err != nil {
					rt.Fatal(err)
				}
				s.Release()
				idx, term := a.Applied()
				if err := b.restoreFrom(&buf, idx, term); err != nil {
					rt.Fatal(err)
				}
			default:
				continue
			}
			if sa, sb := fullState(a), fullState(b); sa != sb {
				rt.Fatalf("after entry %d:\nstraight %s\nreopened %s", w.index, sa, sb)
			}
		}
	})
}

// fullState prints what an FSM holds, beyond its digest too.
func fullState(f *FSM) string {
	st := f.ix.Stats()
	s := fmt.Sprintf("digest %x applied %d\nrankstats %+v\nstats nodes %d entries %d blocks %v orphans %d/%d resync %d over %d\nseqs %+v\nworkers %v settings %+v\nmembers %v\n",
		f.Digest(), f.applied.Load(), f.ix.RankStats(), st.Nodes, st.Entries, st.Blocks,
		st.OrphanEvents, st.OrphanBlocks, st.NeedResync, st.OverCapacity,
		f.seqs.Snapshot(), f.Workers(), f.Settings(), f.Members())
	for _, r := range fsmRanks {
		s += fmt.Sprintf("%v cursor %d has %v inc %d load %+v; ", r, f.Cursor(r), f.HasCursor(r), f.Incarnation(r), f.seqs.Load(r))
	}
	return s
}
