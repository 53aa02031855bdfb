package raftfsm

import (
	"fmt"
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
func (f *FSM) load() error {
	start := time.Now()
	db := f.db
	idx, term, err := db.Applied()
	if err != nil {
		return err
	}
	cursors := map[kvevent.Rank]uint64{}
	workers := map[uint64]WorkerInfo{}
	members := map[string]Member{}
	settings := Settings{Params: indexer.DefaultParams()}
	nodes := map[uint64]indexer.DumpNode{}
	ranks := map[kvevent.Rank]*indexer.RankDump{}
	flags := map[kvevent.Rank][2]bool{}
	rankOf := func(r kvevent.Rank) *indexer.RankDump {
		d := ranks[r]
		if d == nil {
			d = &indexer.RankDump{Rank: r}
			ranks[r] = d
		}
		return d
	}
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
		{store.KindNode, func(k, v []byte) error {
			seq, err := store.DecodeU64(k)
			if err != nil {
				return err
			}
			parent, local, root, err := store.DecodeNode(v)
			nodes[seq] = indexer.DumpNode{Seq: seq, Parent: parent, Root: root, Local: local}
			return err
		}},
		{store.KindEntry, func(k, v []byte) error {
			w, dp, eh, seq, mask, order, err := store.DecodeEntry(k, v)
			if err != nil {
				return err
			}
			d := rankOf(kvevent.Rank{Worker: w, DP: dp})
			d.Entries = append(d.Entries, indexer.DumpEntry{Seq: seq, EngineHash: eh, Mask: kvevent.Mask(mask), Order: order})
			return nil
		}},
		{store.KindRank, func(k, v []byte) error {
			w, dp, err := store.DecodeRankKey(k)
			if err != nil {
				return err
			}
			r := kvevent.Rank{Worker: w, DP: dp}
			m, err := decodeRankMeta(v, r)
			if err != nil {
				return err
			}
			d := rankOf(r)
			d.Capacity, d.Order, d.Orphans = m.Capacity, m.Order, m.Orphans
			flags[r] = [2]bool{m.NeedsResync, m.OverCapacity}
			return nil
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
		if err := db.Scan(s.kind, s.fn); err != nil {
			return fmt.Errorf("rebuild %s from %s: %w", store.KindName(s.kind), f.dir, err)
		}
	}
	list := make([]indexer.RankDump, 0, len(ranks))
	for _, d := range ranks {
		list = append(list, *d)
	}
	if err := f.ix.LoadState(nodes, list); err != nil {
		return fmt.Errorf("rebuild index from %s: %w", f.dir, err)
	}
	for r, fl := range flags {
		f.ix.SetRankFlags(r, fl[0], fl[1])
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
