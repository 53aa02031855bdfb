package raftfsm

import (
	"fmt"
	"runtime"
	"runtime/debug"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/store"
)

// Encodings of the opaque records of the state database, and the start-up
// rebuild of the in-memory state from them.

func encodeRankMeta(e *enc, m *indexer.RankMeta) {
	for _, c := range m.Capacity {
		e.sv(c)
	}
	e.uv(uint64(m.Order))
	e.bool(m.NeedsResync)
	e.bool(m.OverCapacity)
	e.uv(uint64(len(m.Orphans)))
	for _, o := range m.Orphans {
		e.sv(o.At)
		e.u8(uint8(o.Tier))
		e.u64(o.Parent)
		e.uv(uint64(len(o.Blocks)))
		for _, b := range o.Blocks {
			e.u64(b.EngineHash)
			e.u64(b.LocalHash)
		}
	}
}

func decodeRankMeta(b []byte, r kvevent.Rank) (indexer.RankMeta, error) {
	d := dec{b: b}
	m := indexer.RankMeta{Rank: r}
	for i := range m.Capacity {
		m.Capacity[i] = d.sv("capacity")
	}
	m.Order = uint32(d.uv("order"))
	m.NeedsResync = d.bool("needs resync")
	m.OverCapacity = d.bool("over capacity")
	n := d.count("orphans", 11)
	for i := 0; i < n; i++ {
		o := indexer.DumpOrphan{At: d.sv("orphan time"), Tier: kvevent.Tier(d.u8("orphan tier")), Parent: d.u64("orphan parent")}
		k := d.count("orphan blocks", 16)
		for j := 0; j < k; j++ {
			o.Blocks = append(o.Blocks, kvevent.Block{EngineHash: d.u64("engine hash"), LocalHash: d.u64("local hash")})
		}
		m.Orphans = append(m.Orphans, o)
	}
	return m, d.done()
}

func encodeBooking(e *enc, b *indexer.Booking) {
	encodeRank(e, b.Rank)
	e.uv(uint64(len(b.SeqHashes)))
	for _, h := range b.SeqHashes {
		e.u64(h)
	}
	e.uv(uint64(b.ISL))
	e.uv(uint64(b.CachedTokens))
	e.bool(b.PrefillDone)
	e.sv(b.CreatedAt)
	if b.Discount != 0 {
		// A trailing field, written only when set, so that a booking
		// without one is encoded as before the field existed.
		e.uv(uint64(b.Discount))
	}
}

func decodeBooking(id string, v []byte) (indexer.Booking, error) {
	d := dec{b: v}
	b := indexer.Booking{ID: id, Rank: decodeRank(&d)}
	n := d.count("seq hashes", 8)
	b.SeqHashes = make([]uint64, n)
	for i := range b.SeqHashes {
		b.SeqHashes[i] = d.u64("seq hash")
	}
	b.ISL = int(min(d.uv("isl"), 1<<40))
	b.CachedTokens = int(min(d.uv("cached"), 1<<40))
	b.PrefillDone = d.bool("prefill done")
	b.CreatedAt = d.sv("created at")
	if d.err == nil && d.off < len(d.b) {
		if v := d.uv("discount"); v > 0 && v <= indexer.DecayScale {
			b.Discount = uint32(v)
		} else {
			d.fail("discount")
		}
	}
	return b, d.done()
}

func encodeSettingsValue(e *enc, s *Settings) {
	// The settings command's payload after its header is the value.
	full := encodeSettings(0, s)
	e.b = append(e.b, full[3:]...) // version, type, zero time (1 byte varint)
}

func decodeSettingsValue(v []byte) (Settings, error) {
	c, err := decodeCommand(append(encodeHeaderBytes(cmdSettings), v...))
	return c.settings, err
}

func encodeHeaderBytes(t cmdType) []byte {
	var e enc
	encodeHeader(&e, t, 0)
	return e.b
}

// load rebuilds the in-memory state from the state database.
//
// The index is the bulk of it (a tree node and a residency record per
// block): its records go straight into an indexer.Loader, which builds the
// index in one pass (see Loader for why that is fast). The node scan runs
// on its own goroutine beside the residency and rank scans, and builds the
// tree (Loader.LinkNodes) as soon as it has every node: they read disjoint
// key ranges of the database and fill disjoint parts of the Loader, and on
// two cores that halves the time spent in Pebble's iterators and hides
// most of the tree's construction. The small kinds are read after. Then
// the residencies are added in one part per processor (Loader.Spread).
//
// The heap grows from nothing to the index's size while loading, and all
// of it stays live: collections during the load would find nothing to
// free, and each would trace the whole heap built so far. So the collector
// is turned off for the load and restored after (loadGCPercent).
func (f *FSM) load() error {
	start := time.Now()
	defer raiseGCPercent(loadGCPercent)()
	db := f.db
	idx, term, err := db.Applied()
	if err != nil {
		return err
	}
	l := indexer.NewLoader(0, 0)
	l.Spread(runtime.GOMAXPROCS(0), spreadGo)
	scan := func(kind byte, fn func(k, v []byte) error) error {
		if err := db.Scan(kind, fn); err != nil {
			return fmt.Errorf("rebuild %s from %s: %w", store.KindName(kind), f.dir, err)
		}
		return nil
	}
	nodesDone := make(chan error, 1)
	go func() {
		err := scan(store.KindNode, func(k, v []byte) error {
			seq, err := store.DecodeU64(k)
			if err != nil {
				return err
			}
			parent, local, root, err := store.DecodeNode(v)
			l.AddNode(seq, parent, root, local)
			return err
		})
		if err == nil {
			l.LinkNodes() // the tree, while the residencies are still read
		}
		nodesDone <- err
	}()
	err = scan(store.KindEntry, func(k, v []byte) error {
		w, dp, eh, seq, mask, order, err := store.DecodeEntry(k, v)
		if err != nil {
			return err
		}
		l.AddEntry(kvevent.Rank{Worker: w, DP: dp}, eh, seq, kvevent.Mask(mask), order)
		return nil
	})
	if err == nil {
		err = scan(store.KindRank, func(k, v []byte) error {
			w, dp, err := store.DecodeRankKey(k)
			if err != nil {
				return err
			}
			m, err := decodeRankMeta(v, kvevent.Rank{Worker: w, DP: dp})
			if err != nil {
				return err
			}
			l.AddRank(m)
			return nil
		})
	}
	if nerr := <-nodesDone; err == nil {
		err = nerr
	}
	if err != nil {
		return err
	}

	cursors := map[kvevent.Rank]uint64{}
	workers := map[uint64]WorkerInfo{}
	members := map[string]Member{}
	settings := Settings{Params: indexer.DefaultParams()}
	var snap indexer.SequencesSnapshot
	scans := []struct {
		kind byte
		fn   func(k, v []byte) error
	}{
		{store.KindCursor, func(k, v []byte) error {
			w, dp, err := store.DecodeRankKey(k)
			if err != nil {
				return err
			}
			c, err := store.DecodeU64(v)
			cursors[kvevent.Rank{Worker: w, DP: dp}] = c
			return err
		}},
		{store.KindWorker, func(k, v []byte) error {
			d := dec{b: v}
			w := decodeWorker(&d)
			workers[w.ID] = w
			return d.done()
		}},
		{store.KindBooking, func(k, v []byte) error {
			b, err := decodeBooking(string(k), v)
			snap.Bookings = append(snap.Bookings, b)
			return err
		}},
		{store.KindTomb, func(k, v []byte) error {
			d := dec{b: v}
			snap.Freed = append(snap.Freed, indexer.FreedBooking{ID: string(k), CreatedAt: d.sv("created at")})
			return d.done()
		}},
		{store.KindLoadMeta, func(k, v []byte) error {
			d := dec{b: v}
			snap.Swept, snap.Horizon = true, d.sv("horizon")
			return d.done()
		}},
		{store.KindSettings, func(k, v []byte) error {
			s, err := decodeSettingsValue(v)
			settings = s
			return err
		}},
		{store.KindMember, func(k, v []byte) error {
			d := dec{b: v}
			members[string(k)] = Member{ID: string(k), RaftAddr: d.str("raft addr"), HTTPAddr: d.str("http addr")}
			return d.done()
		}},
	}
	for _, s := range scans {
		if err := scan(s.kind, s.fn); err != nil {
			return err
		}
	}
	if err := l.Finish(f.ix); err != nil {
		return fmt.Errorf("rebuild index from %s: %w", f.dir, err)
	}
	if err := f.seqs.Restore(snap); err != nil {
		return fmt.Errorf("rebuild bookings from %s: %w", f.dir, err)
	}
	f.curMu.Lock()
	f.cursors = cursors
	f.curMu.Unlock()
	f.setWorkers(workers)
	f.members.Store(&members)
	f.settings.Store(&settings)
	f.applied.Store(idx)
	f.appliedTerm.Store(term)
	st := f.ix.Stats()
	f.logger.Info("state loaded", "applied_index", idx, "nodes", st.Nodes, "entries", st.Entries,
		"workers", len(workers), "bookings", len(snap.Bookings), "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// spreadGo runs f(0) … f(parts-1) each on a goroutine and waits for them
// (indexer.Loader.Spread: the indexer starts no goroutines itself).
func spreadGo(parts int, f func(part int)) {
	var wg sync.WaitGroup
	for p := 1; p < parts; p++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f(p)
		}()
	}
	f(0)
	wg.Wait()
}

// loadGCPercent is GOGC while the state loads (see FSM.load): off. The
// heap grows from nothing to the index's size and nearly all of it stays
// live (the loader's record chunks never move), so a collection during the
// load would find little to free and trace everything built so far; on
// the 5M-block restart benchmark, collections at GOGC=800 cost about
// 0.6 s of the restart. A memory limit (GOMEMLIMIT) still applies: the
// runtime collects when the heap nears it.
const loadGCPercent = -1

// raiseGCPercent sets GOGC to p (a higher setting, or collection already
// off, is left as it is; p < 0 turns collection off) and returns the
// function that restores the previous setting.
func raiseGCPercent(p int) (restore func()) {
	prev := debug.SetGCPercent(p)
	if prev < 0 || (p >= 0 && prev >= p) {
		debug.SetGCPercent(prev)
		return func() {}
	}
	return func() { debug.SetGCPercent(prev) }
}
