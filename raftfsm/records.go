package raftfsm

import (
	"bytes"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/internal/rankmap"
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
// block): its records go straight into an indexer.Loader (stateBuilder),
// which builds the index in one pass (see Loader for why that is fast).
// Two goroutines read the two halves of the node records side by side;
// then one builds the tree (Loader.LinkNodes) while the other reads the
// residencies and ranks: they read disjoint key ranges of the database
// and fill disjoint parts of the Loader, and on two cores that halves
// the time spent in Pebble's iterators and hides most of the tree's
// construction. (With the whole node scan on one goroutine, the
// residency scan finished about a second before the tree.) The small
// kinds are read after. Then the residencies are added in one part per
// processor (Loader.Spread).
//
// The collector is off during the load, and after it too when
// holdAfterLoad is set (collector.go).
func (f *FSM) load() (err error) {
	start := time.Now()
	defer holdCollector()()
	defer func() {
		// Taken before the load's own hold is released (defers run last
		// first), so that no collection starts in between.
		if err == nil && f.holdAfterLoad {
			release := holdCollectorAfterLoad()
			f.loadHold.Store(&release)
		}
	}()
	db := f.db
	b := newStateBuilder()
	b.applied, b.appliedTerm, err = f.storedApplied()
	if err != nil {
		return err
	}
	// The load reads the kinds it knows; a record of another kind would
	// be left out of the state and of every snapshot in silence (a
	// snapshot's reader refuses the kind). The state database keeps no
	// format version: such a record is a later build's, or damage.
	if k, err := db.UnknownRecord(); err != nil {
		return fmt.Errorf("rebuild the state from %s: %w", f.dir, err)
	} else if k != nil {
		kind := "an empty key"
		if len(k) > 0 {
			kind = fmt.Sprintf("kind %#02x", k[0])
		}
		return fmt.Errorf("rebuild the state from %s: a record of %s (key %x), which this build does not know: "+
			"a later build wrote it (run that build or a later one), or %s is damaged (remove it: the node takes the state from its Raft snapshots and log, or from the cluster): %w",
			f.dir, kind, k, f.dir, store.ErrUnsupportedVersion)
	}
	scanRange := func(kind byte, from, to []byte, fn func(k, v []byte) error) error {
		if err := db.ScanRange(kind, from, to, fn); err != nil {
			return fmt.Errorf("rebuild %s from %s: %w", store.KindName(kind), f.dir, err)
		}
		return nil
	}
	scan := func(kind byte, fn func(k, v []byte) error) error { return scanRange(kind, nil, nil, fn) }
	// The node records are read in two halves side by side (their keys
	// are sequence hashes: the halves are about even), the upper half
	// apart from the Loader; the tree is then built on one goroutine
	// while the other reads the residencies.
	half := []byte{0x80}
	upper := b.l.NodeRecords()
	upperDone, nodesDone := make(chan error, 1), make(chan error, 1)
	go func() {
		err := scanRange(store.KindNode, nil, half, b.node)
		if uerr := <-upperDone; err == nil {
			err = uerr
		}
		if err == nil {
			b.l.AddNodes(upper)
			b.l.LinkNodes() // the tree, while the residencies are still read
		}
		nodesDone <- err
	}()
	err = scanRange(store.KindNode, half, nil, func(k, v []byte) error {
		seq, parent, local, root, err := decodeNodeRecord(k, v)
		upper.Add(seq, parent, root, local)
		return err
	})
	upperDone <- err
	if err == nil {
		err = scan(store.KindEntry, b.entry)
	}
	if err == nil {
		err = scan(store.KindRank, b.rank)
	}
	if nerr := <-nodesDone; err == nil {
		err = nerr
	}
	if err != nil {
		b.discard()
		return err
	}
	for _, kind := range []byte{store.KindCursor, store.KindWorker, store.KindBooking, store.KindTomb,
		store.KindLoadMeta, store.KindSettings, store.KindMember} {
		if err := scan(kind, func(k, v []byte) error { return b.small(kind, k, v) }); err != nil {
			b.discard()
			return err
		}
	}
	if err := b.install(f); err != nil {
		return fmt.Errorf("rebuild from %s: %w", f.dir, err)
	}
	f.logLoaded("state loaded", b, start)
	return nil
}

// storedApplied reads the applied index and term from the state
// database; a record that does not decode is refused naming the
// directory and what to do, as a damaged record of any other kind is.
func (f *FSM) storedApplied() (uint64, uint64, error) {
	idx, term, err := f.db.Applied()
	if errors.Is(err, store.ErrCorrupt) {
		return 0, 0, fmt.Errorf("rebuild the state from %s: its applied index: %w: %s is damaged; remove it "+
			"(the node takes the state from its Raft snapshots and log, or from the cluster)", f.dir, err, f.dir)
	} else if err != nil {
		return 0, 0, fmt.Errorf("read the applied index of %s: %w", f.dir, err)
	}
	return idx, term, nil
}

// logLoaded logs what a rebuild installed.
func (f *FSM) logLoaded(msg string, b *stateBuilder, start time.Time) {
	st := f.ix.Stats()
	f.logger.Info(msg, "applied_index", b.applied, "nodes", st.Nodes, "entries", st.Entries,
		"workers", len(b.workers), "bookings", len(b.snap.Bookings), "took", time.Since(start).Round(time.Millisecond))
}

// stateBuilder gathers the records of a state database — scanned from
// Pebble at start (FSM.load), or taken from a snapshot stream while it is
// restored (restoreFrom) — and installs the in-memory state they describe
// (install). Nothing it gathers is visible until install.
//
// The record methods take a key without its kind byte. node may run
// beside entry and rank (they fill disjoint parts of the Loader); the
// tree is built (l.LinkNodes) once every node is in, and may run beside
// entry and rank too.
type stateBuilder struct {
	l                    *indexer.Loader
	applied, appliedTerm uint64
	cursors              rankmap.Map[rankCursor]
	workers              map[uint64]WorkerInfo
	members              map[string]Member
	settings             Settings
	snap                 indexer.SequencesSnapshot
	clockSet             bool // snap.Clock came from a clock record

	// The stream path (add): the tree is linked on its own goroutine
	// from the first record after the nodes; linked reports its end.
	linked   chan struct{}
	lastKind byte  // the kind of add's last record
	err      error // add's first error; add ignores records after it
	// For canonical: the node and residency records add took, and the
	// first record small took under a key the state does not write it at.
	nodeRecs, entryRecs int64
	stray               error
	// names has node check each node record's key against the name the
	// write path gives its position (checkSnapshot sets it).
	names bool

	built *indexer.Index // prepare's index, for install
}

func newStateBuilder() *stateBuilder {
	l := indexer.NewLoader(0, 0)
	l.Spread(runtime.GOMAXPROCS(0), spreadGo)
	return &stateBuilder{
		l:        l,
		workers:  map[uint64]WorkerInfo{},
		members:  map[string]Member{},
		settings: Settings{Params: indexer.DefaultParams()},
	}
}

// node adds a tree node record.
func (b *stateBuilder) node(k, v []byte) error {
	seq, parent, local, root, err := decodeNodeRecord(k, v)
	b.l.AddNode(seq, parent, root, local)
	if b.names && err == nil {
		// A node is named by its position: a root child by its content
		// hash, a deeper node by its parent's name and its content hash
		// (indexer.Index.Store). A record under another name loads under
		// it, and the index then refuses as a name collision a block
		// that a state built from events takes.
		name := local
		if !root {
			name = kvevent.SequenceHash(parent, local)
		}
		if seq != name {
			b.strayKey(fmt.Errorf("tree node %#x named %#x by its position", seq, name))
		}
	}
	return err
}

// decodeNodeRecord decodes a tree node record (key without its kind).
func decodeNodeRecord(k, v []byte) (seq, parent, local uint64, root bool, err error) {
	if seq, err = store.DecodeU64(k); err != nil {
		return 0, 0, 0, false, err
	}
	parent, local, root, err = store.DecodeNode(v)
	return seq, parent, local, root, err
}

// entry adds a residency record.
func (b *stateBuilder) entry(k, v []byte) error {
	w, dp, eh, seq, mask, order, err := store.DecodeEntry(k, v)
	if err != nil {
		return err
	}
	b.l.AddEntry(kvevent.Rank{Worker: w, DP: dp}, eh, seq, kvevent.Mask(mask), order)
	return nil
}

// rank adds a rank metadata record.
func (b *stateBuilder) rank(k, v []byte) error {
	w, dp, err := store.DecodeRankKey(k)
	if err != nil {
		return err
	}
	m, err := decodeRankMeta(v, kvevent.Rank{Worker: w, DP: dp})
	if err != nil {
		return err
	}
	b.l.AddRank(m)
	return nil
}

// small adds a record of one of the other kinds.
func (b *stateBuilder) small(kind byte, k, v []byte) error {
	switch kind {
	case store.KindApplied:
		idx, term, err := store.DecodeApplied(v)
		b.applied, b.appliedTerm = idx, term
		return err
	case store.KindCursor:
		w, dp, err := store.DecodeRankKey(k)
		if err != nil {
			return err
		}
		id, inc, err := store.DecodeCursor(v)
		b.cursors.Set(kvevent.Rank{Worker: w, DP: dp}, rankCursor{id: id, incarnation: inc})
		return err
	case store.KindWorker:
		// The id is the value's; the key is where the state writes and
		// deletes the record (u64key(id)).
		d := dec{b: v}
		w := decodeWorker(&d)
		b.workers[w.ID] = w
		if err := d.done(); err != nil {
			return laterRecord("worker", k, err)
		}
		if !bytes.Equal(k, u64key(w.ID)) {
			b.strayKey(fmt.Errorf("worker %d under the key %x", w.ID, k))
		}
		return nil
	case store.KindBooking:
		bk, err := decodeBooking(string(k), v)
		b.snap.Bookings = append(b.snap.Bookings, bk)
		return err
	case store.KindTomb:
		d := dec{b: v}
		b.snap.Freed = append(b.snap.Freed, indexer.FreedBooking{ID: string(k), CreatedAt: d.sv("created at")})
		return d.done()
	case store.KindLoadMeta:
		// Key 'c' is the sweeps' clock. Key 'l' is what builds before it
		// kept instead: the expiry horizon, the latest sweep's time less
		// its max age, a lower bound of the clock, taken as the clock
		// until a sweep's time is later (docs/operations.md, Upgrade: a
		// node that applied that sweep on this build holds its time, so
		// the two disagree until then). 'c' sorts first, and a node
		// writes one of them only; 'l' never overrides a 'c'.
		d := dec{b: v}
		switch {
		case len(k) == 1 && k[0] == loadMetaClock:
			b.snap.Swept, b.snap.Clock, b.clockSet = true, d.sv("sweep clock"), true
		case len(k) == 1 && k[0] == loadMetaHorizon:
			h := d.sv("horizon")
			if !b.clockSet {
				b.snap.Swept, b.snap.Clock = true, h
			} else {
				b.strayKey(errors.New("an earlier build's expiry horizon beside the sweep clock"))
			}
		default:
			return fmt.Errorf("%w: load meta record %q", store.ErrCorrupt, k)
		}
		return d.done()
	case store.KindSettings:
		s, err := decodeSettingsValue(v)
		b.settings = s
		if err == nil && string(k) != "s" {
			b.strayKey(fmt.Errorf("settings under the key %q", k))
		}
		if err == nil {
			if verr := s.Params.ValidateStored(); verr != nil {
				// No build stores them (each refused them in SetSettings,
				// and the FSM skips an entry of them), and installed they
				// fail every route (Select refuses them).
				b.strayKey(fmt.Errorf("settings no build stores: %v", verr))
			}
		}
		return laterRecord("settings", k, err)
	case store.KindMember:
		d := dec{b: v}
		b.members[string(k)] = Member{ID: string(k), RaftAddr: d.str("raft addr"), HTTPAddr: d.str("http addr")}
		return d.done()
	}
	return fmt.Errorf("%w: record of kind %#x", store.ErrCorrupt, kind)
}

// laterRecord names the record (what, under key k) that a later build
// wrote (err is ErrLaterBuild) and what to do: the state is not read
// without it. Other errors it returns as they are.
func laterRecord(what string, k []byte, err error) error {
	if !errors.Is(err, ErrLaterBuild) {
		return err
	}
	return fmt.Errorf("the %s record under the key %x: %w: run that build or a later one", what, k, err)
}

// strayKey notes, for canonical, a record the state would not write where
// it is (the first one).
func (b *stateBuilder) strayKey(err error) {
	if b.stray == nil {
		b.stray = err
	}
}

// add adds one record of a snapshot stream (the full key, kind byte
// first). Records come in key order, so every tree node comes before any
// later kind: the first record past the nodes starts the tree's linking
// on its own goroutine, beside the residencies that follow. After an
// error add ignores everything; it returns b.err.
func (b *stateBuilder) add(key, value []byte) error {
	if b.err != nil {
		return b.err
	}
	kind, k := key[0], key[1:]
	if kind < b.lastKind {
		// The stream's writer refuses keys out of order too, but only
		// after this: a node added while the tree is linked would race.
		b.err = fmt.Errorf("%w: %s record after a %s record", store.ErrCorrupt, store.KindName(kind), store.KindName(b.lastKind))
		return b.err
	}
	b.lastKind = kind
	if kind > store.KindNode {
		b.startLink()
	}
	var err error
	switch kind {
	case store.KindNode:
		b.nodeRecs++
		err = b.node(k, value)
	case store.KindEntry:
		b.entryRecs++
		err = b.entry(k, value)
	case store.KindRank:
		err = b.rank(k, value)
	default:
		err = b.small(kind, k, value)
	}
	switch {
	case errors.Is(err, ErrLaterBuild):
		b.err = err // laterRecord named the record
	case err != nil:
		b.err = fmt.Errorf("%s record: %w", store.KindName(kind), err)
	}
	return b.err
}

// startLink starts linking the tree, once.
func (b *stateBuilder) startLink() {
	if b.linked != nil {
		return
	}
	b.linked = make(chan struct{})
	go func() {
		defer close(b.linked)
		b.l.LinkNodes()
	}()
}

// wait waits for a linking add started; it returns add's error.
func (b *stateBuilder) wait() error {
	if b.linked != nil {
		<-b.linked
	}
	return b.err
}

// discard waits for a linking add started and drops the Loader's records
// (Loader.Discard), for a build abandoned on an error; it returns add's
// error.
func (b *stateBuilder) discard() error {
	err := b.wait()
	b.l.Discard()
	return err
}

// prepare builds the index apart from f's (Loader.FinishDetached) and
// checks the bookings, so that records that do not make a consistent
// state are refused before anything is replaced (a restore calls it
// before its swap). install then only moves the result in.
// like gives the index's configuration (the FSM's index).
func (b *stateBuilder) prepare(like *indexer.Index) error {
	if b.linked != nil {
		<-b.linked
	}
	ix, err := b.l.FinishDetached(like) // links the tree if no one did
	if err != nil {
		return fmt.Errorf("index: %w", err)
	}
	if err := indexer.NewSequences().Restore(b.snap); err != nil {
		return fmt.Errorf("bookings: %w", err)
	}
	b.built = ix
	return nil
}

// canonical checks, after prepare, that the records add took are one per
// item of the state built from them, each under the key that state
// writes it at: that every later change of the state replaces or deletes
// the very record that holds the item. The Loader accepts more, and loads
// it as the write path would: two residency records of one rank on one
// node (one is kept, under the newest engine hash), two node records at
// one position (one node), node records that do not reach the root or
// lead to no residency (not kept). The state database still holds every
// record, and the ones the index dropped are never deleted: a residency
// of a freed node, loaded at the next start, fails it ("missing or in a
// cycle"). The same goes for a worker record under another worker's key
// (its id is read from the value) and settings under a key other than
// 's': the deregister and the settings applied later change the record at
// the right key, and the other one comes back at the next start. An
// earlier build's expiry horizon beside the sweep clock is not loaded
// (the clock wins) but kept, which no state does. Nor does any state hold
// settings of a NaN, infinite or negative weight (no build stores them:
// installed, they fail every route). So a stream whose
// records are not canonical is refused by the check before a user
// restore or a seed (checkSnapshot). Raft's own restores do not ask
// (restoreFrom): their streams are a node's database, which the journal
// writes one record per item, and a follower must take the state its
// leader runs on.
//
// With keys strictly rising, a record per key, the counts tell it: every
// node record builds its own node and keeps it, every residency record
// its own residency.
func (b *stateBuilder) canonical() error {
	if b.stray != nil {
		return b.stray
	}
	st := b.built.Stats()
	if st.Nodes != b.nodeRecs {
		return fmt.Errorf("%d tree node records make %d nodes: records name one position twice, do not reach the root, or lead to no residency", b.nodeRecs, st.Nodes)
	}
	if st.Entries != b.entryRecs {
		return fmt.Errorf("%d residency records make %d residencies: a rank holds a node under two engine hashes", b.entryRecs, st.Entries)
	}
	return nil
}

// install finishes the index into f.ix, or moves in the one prepare
// built, and installs the rest of the state in f. The caller excludes
// applies (start, or dbMu held).
func (b *stateBuilder) install(f *FSM) error {
	// The state and its applied index change together under stateMu, as
	// in ApplyBatch: a status read during a restore (AppliedDigest) pairs
	// the old index with the old state or the new with the new, never an
	// index with a half-installed state. Nothing here does I/O.
	f.stateMu.Lock()
	defer f.stateMu.Unlock()
	if b.built != nil {
		f.ix.Take(b.built)
		b.built = nil
	} else {
		if b.linked != nil {
			<-b.linked
		}
		if err := b.l.Finish(f.ix); err != nil { // links the tree if no one did
			return fmt.Errorf("index: %w", err)
		}
	}
	f.pending.mu.Lock()
	err := f.seqs.Restore(b.snap)
	f.pending.mu.Unlock()
	if err != nil {
		return fmt.Errorf("bookings: %w", err)
	}
	// The last-heard and registration times are the replaced state's
	// (they are in memory only, and no record carries them): a restore
	// drops them with the cursors, as a node that restored the stream at
	// its start holds none. Kept, they listed ranks the restored state
	// never had as unregistered (the leader's sweep then removed workers
	// that do not exist) and answered LastHeard and RegisteredAt with
	// stale times. restoredAt stands in for them (Node.Ranks).
	f.curMu.Lock()
	f.cursors = b.cursors
	f.heard = rankmap.Map[int64]{}
	f.registered = nil
	f.curMu.Unlock()
	f.setWorkers(b.workers)
	f.members.Store(&b.members)
	f.settings.Store(&b.settings)
	f.applied.Store(b.applied)
	f.appliedTerm.Store(b.appliedTerm)
	f.halt.Store(nil) // a restored state is past any entry the FSM halted at, or replays it
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
