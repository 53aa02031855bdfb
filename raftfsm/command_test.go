package raftfsm

import (
	"bytes"
	"encoding/hex"
	"errors"
	"io"
	"path/filepath"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/hashicorp/raft"
	"github.com/kvrouter/kvrouter/indexer"
	"github.com/kvrouter/kvrouter/kvevent"
	"github.com/kvrouter/kvrouter/store"
	"pgregory.net/rapid"
)

// TestWorkerEncodingRoundTrip: a registration with every field decodes to
// itself, and one encoded before extension 1 (ending after the model)
// still decodes, with the compatible APIs' fields empty.
func TestWorkerEncodingRoundTrip(t *testing.T) {
	full := WorkerInfo{ID: 1<<63 | 7, DPRanks: []uint32{0, 3}, BlockSize: 16, Capacity: [4]int64{10, 20, 0, -1},
		Endpoint: "http://w:8000", Model: "llama", Tenant: "blue", Instance: 42,
		EventEndpoints:  map[uint32]string{0: "tcp://w:5557", 3: "tcp://w:5560"},
		ReplayEndpoints: map[uint32]string{3: "tcp://w:5570"}, Salt: "s", LeaseMs: 10000, Positional: true}
	c, err := decodeCommand(encodeRegister(9, &full))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c.worker, full) {
		t.Fatalf("decoded %+v\nwant    %+v", c.worker, full)
	}
	// Equal maps encode to equal bytes, whatever their iteration order.
	first := string(encodeRegister(9, &full))
	for i := 0; i < 20; i++ {
		if again := string(encodeRegister(9, &full)); again != first {
			t.Fatal("the encoding depends on map order")
		}
	}

	old := WorkerInfo{ID: 5, DPRanks: []uint32{0}, BlockSize: 16, Endpoint: "e", Model: "m"}
	var e enc
	encodeHeader(&e, cmdRegister, 9)
	encodeWorker(&e, &old)
	b := e.b[:len(e.b)-8] // drop extension 1: its marker byte, empty tenant, instance 0, two empty maps, empty salt, lease 0, not positional
	if b[len(b)-1] != 'm' {
		t.Fatalf("extension 1 is not 8 bytes here: %x", e.b)
	}
	c, err = decodeCommand(b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(c.worker, old) {
		t.Fatalf("old encoding decoded %+v, want %+v", c.worker, old)
	}
	// An unknown extension is refused, not misread.
	bad := append(append([]byte(nil), b...), 2)
	if _, err := decodeCommand(bad); err == nil {
		t.Fatal("extension 2 decoded")
	}
}

// TestEventCommandsAreSizedOnce: the event commands' buffers are sized
// from eventBound before encoding, so encoding never grows them (a grown
// buffer is garbage the size of the entry), and they decode to what was
// encoded, for events of every kind and field width.
func TestEventCommandsAreSizedOnce(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		batches := genRankBatches(rt)
		size := 64
		for i := range batches {
			size += 40 + eventsBound(batches[i].Events)
		}
		now := rapid.Int64().Draw(rt, "now")
		b := encodeEvents(now, batches)
		if cap(b) != size {
			rt.Fatalf("encoding grew the buffer: capacity %d, sized %d (%d bytes written)", cap(b), size, len(b))
		}
		c, err := decodeCommand(b)
		if err != nil {
			rt.Fatal(err)
		}
		if len(c.batches) != len(batches) {
			rt.Fatalf("decoded %d batches, want %d", len(c.batches), len(batches))
		}
		for i := range batches {
			if c.batches[i].Rank != batches[i].Rank || c.batches[i].Incarnation != batches[i].Incarnation ||
				len(c.batches[i].Events) != len(batches[i].Events) {
				rt.Fatalf("batch %d decoded as %+v", i, c.batches[i])
			}
			for j := range batches[i].Events {
				got, want := c.batches[i].Events[j], batches[i].Events[j]
				if got.EventID != want.EventID || got.Kind != want.Kind || got.Tier != want.Tier || got.HasParent != want.HasParent ||
					got.Parent != want.Parent || len(got.Blocks) != len(want.Blocks) || len(got.Removed) != len(want.Removed) {
					rt.Fatalf("event %d.%d decoded as %+v, want %+v", i, j, got, want)
				}
			}
		}
		if len(batches) == 1 {
			r := batches[0].Rank
			b := encodeReplace(now, r, 7, batches[0].Incarnation, batches[0].Events)
			if want := 104 + eventsBound(batches[0].Events); cap(b) != want {
				rt.Fatalf("replace encoding grew the buffer: capacity %d, sized %d", cap(b), want)
			}
			if c, err := decodeCommand(b); err != nil || c.rank != r || c.cursor != 7 || c.incarnation != batches[0].Incarnation {
				rt.Fatalf("dump decoded as rank %v cursor %d incarnation %d (%v), want %v 7 %d",
					c.rank, c.cursor, c.incarnation, err, r, batches[0].Incarnation)
			}
		}
	})
}

// genRankBatches draws event batches of every kind and field width.
func genRankBatches(rt *rapid.T) []RankBatch {
	u64 := rapid.OneOf(rapid.Uint64Range(0, 300), rapid.Uint64())
	var batches []RankBatch
	for i, n := 0, rapid.IntRange(0, 4).Draw(rt, "batches"); i < n; i++ {
		r := kvevent.Rank{Worker: u64.Draw(rt, "worker"), DP: rapid.Uint32().Draw(rt, "dp")}
		var evs []kvevent.Event
		for j, m := 0, rapid.IntRange(0, 5).Draw(rt, "events"); j < m; j++ {
			ev := kvevent.Event{Rank: r, EventID: u64.Draw(rt, "id"), Tier: kvevent.Tier(rapid.IntRange(0, 3).Draw(rt, "tier"))}
			switch rapid.IntRange(0, 2).Draw(rt, "kind") {
			case 0:
				ev.Kind = kvevent.KindStored
				if ev.HasParent = rapid.Bool().Draw(rt, "has parent"); ev.HasParent {
					ev.Parent = u64.Draw(rt, "parent")
				}
				for k, nb := 0, rapid.IntRange(0, 40).Draw(rt, "blocks"); k < nb; k++ {
					ev.Blocks = append(ev.Blocks, kvevent.Block{EngineHash: u64.Draw(rt, "eh"), LocalHash: u64.Draw(rt, "lh")})
				}
			case 1:
				ev.Kind = kvevent.KindRemoved
				ev.Removed = rapid.SliceOfN(u64, 0, 40).Draw(rt, "removed")
			default:
				ev.Kind = kvevent.KindCleared
			}
			evs = append(evs, ev)
		}
		inc := rapid.SampledFrom([]uint64{0, 1, 1<<64 - 1}).Draw(rt, "incarnation")
		batches = append(batches, RankBatch{Rank: r, Incarnation: inc, Events: evs})
	}
	return batches
}

// TestDecodeScratchMatchesFreshDecode: commands decoded one after another
// into one reused decodeScratch (as ApplyBatch does) decode exactly as
// each would alone: nothing of an earlier command shows through (a stored
// event's blocks or parent left in the slot of a later removal), events
// and rank dumps alike.
func TestDecodeScratchMatchesFreshDecode(t *testing.T) {
	rapid.Check(t, func(rt *rapid.T) {
		var sc decodeScratch
		for k, n := 0, rapid.IntRange(1, 6).Draw(rt, "commands"); k < n; k++ {
			batches := genRankBatches(rt)
			b := encodeEvents(int64(k), batches)
			if len(batches) > 0 && rapid.Bool().Draw(rt, "dump") {
				b = encodeReplace(int64(k), batches[0].Rank, 9, batches[0].Incarnation, batches[0].Events)
			}
			sc.reset()
			got, err := decodeCommandInto(b, &sc)
			if err != nil {
				rt.Fatal(err)
			}
			want, err := decodeCommand(b)
			if err != nil {
				rt.Fatal(err)
			}
			if !reflect.DeepEqual(got, want) {
				rt.Fatalf("command %d decoded into the reused scratch as\n%+v\nalone as\n%+v", k, got, want)
			}
		}
	})
}

// Commands as a build before publisher incarnations wrote them (command
// format version 1), as a Raft log may still hold them: encodeEvents(42,
// one batch of rank {7 1}: two stored events, ids 4 and 5, and a removal,
// id 6) and encodeReplace(43, rank {7 1}, cursor 9, two stored events).
const (
	v1EventsHex  = "0101540107010304010000010a00000000000000f203000000000000050100010a00000000000000010b00000000000000f303000000000000060200010b00000000000000"
	v1ReplaceHex = "0102560701090201010000011400000000000000fc03000000000000020100011400000000000000011500000000000000fd03000000000000"
)

// TestVersion1CommandsStillDecode: event batches and rank dumps entries
// written before incarnations (version 1) decode as they did, with
// incarnation 0 (unfenced), and apply; unfenced ones are still written so,
// fenced ones in version 2, and a later version is refused.
func TestVersion1CommandsStillDecode(t *testing.T) {
	r := kvevent.Rank{Worker: 7, DP: 1}
	evs, err := hex.DecodeString(v1EventsHex)
	if err != nil {
		t.Fatal(err)
	}
	c, err := decodeCommand(evs)
	if err != nil {
		t.Fatalf("a version 1 events entry: %v", err)
	}
	want := append(chainEvents(r, 4, 2, 10), kvevent.Event{Rank: r, EventID: 6, Kind: kvevent.KindRemoved, Removed: []uint64{11}})
	if c.typ != cmdEvents || c.now != 42 || len(c.batches) != 1 || c.batches[0].Rank != r || c.batches[0].Incarnation != 0 ||
		!reflect.DeepEqual(c.batches[0].Events, want) {
		t.Fatalf("a version 1 events entry decoded as %+v", c)
	}
	// Unfenced, it is written as it was (nodes of earlier builds read what
	// a leader of this build writes until agents send incarnations); with
	// an incarnation, in version 2.
	if again := encodeEvents(42, c.batches); !bytes.Equal(again, evs) {
		t.Fatalf("unfenced batches written as %x, want the version 1 entry %x", again, evs)
	}
	c.batches[0].Incarnation = 5
	if again := encodeEvents(42, c.batches); again[0] != 2 {
		t.Fatalf("fenced batches written in version %d, want 2", again[0])
	}

	rep, err := hex.DecodeString(v1ReplaceHex)
	if err != nil {
		t.Fatal(err)
	}
	c, err = decodeCommand(rep)
	if err != nil {
		t.Fatalf("a version 1 dump entry: %v", err)
	}
	if c.typ != cmdReplace || c.now != 43 || c.rank != r || c.cursor != 9 || c.incarnation != 0 ||
		!reflect.DeepEqual(c.stored, chainEvents(r, 1, 2, 20)) {
		t.Fatalf("a version 1 dump entry decoded as %+v", c)
	}
	if again := encodeReplace(43, r, 9, 0, c.stored); !bytes.Equal(again, rep) {
		t.Fatalf("an unfenced dump written as %x, want the version 1 entry %x", again, rep)
	}
	if again := encodeReplace(43, r, 9, 5, c.stored); again[0] != 2 {
		t.Fatalf("a fenced dump written in version %d, want 2", again[0])
	}

	// Both apply, as in the build that wrote them.
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	res := f.ApplyBatch([]*raft.Log{w.next(rep), w.next(evs)})
	if acks, ok := res[1].([]RankAck); !ok || acks[0].Applied != 0 || acks[0].Dups != 3 || f.Cursor(r) != 9 || f.Incarnation(r) != 0 {
		t.Fatalf("applied: %v; cursor %d incarnation %d, want 9 and 0 (the events at or below the dump's cursor are duplicates)",
			res, f.Cursor(r), f.Incarnation(r))
	}

	later := bytes.Clone(rep)
	later[0] = commandVersion + 1
	if _, err := decodeCommand(later); !errors.Is(err, ErrBadCommand) {
		t.Fatalf("version %d: %v, want ErrBadCommand", later[0], err)
	}
}

// TestDecodeIntoWarmScratchAllocatesNothing: ApplyBatch decodes every
// events entry into one reused decodeScratch; once its arrays have grown
// to an entry's size, decoding the next such entry allocates nothing.
func TestDecodeIntoWarmScratchAllocatesNothing(t *testing.T) {
	var batches []RankBatch
	for w := uint64(1); w <= 3; w++ {
		r := kvevent.Rank{Worker: w, DP: 1}
		rb := RankBatch{Rank: r, Incarnation: w}
		for i := range 50 {
			ev := kvevent.Event{Rank: r, EventID: uint64(i + 1), Kind: kvevent.KindStored, HasParent: i > 0, Parent: uint64(i)}
			ev.Blocks = []kvevent.Block{{EngineHash: uint64(i), LocalHash: uint64(i) + 7}, {EngineHash: uint64(i) + 1, LocalHash: uint64(i) + 8}}
			if i%5 == 4 {
				ev = kvevent.Event{Rank: r, EventID: uint64(i + 1), Kind: kvevent.KindRemoved, Removed: []uint64{uint64(i)}}
			}
			rb.Events = append(rb.Events, ev)
		}
		batches = append(batches, rb)
	}
	b := encodeEvents(1, batches)
	var sc decodeScratch
	if _, err := decodeCommandInto(b, &sc); err != nil {
		t.Fatal(err)
	}
	allocs := testing.AllocsPerRun(50, func() {
		sc.reset()
		if _, err := decodeCommandInto(b, &sc); err != nil {
			t.Fatal(err)
		}
	})
	if allocs != 0 {
		t.Fatalf("decoding 150 events into a warm scratch took %.0f allocations, want 0", allocs)
	}
}

// TestDecodingABookEntryAllocatesAboutItsSize: a book entry's operations
// are not decoded into a slice of 88-byte bookOps (from as few as 2 bytes
// of the entry each: 44 bytes per entry byte, a 64 MiB entry 2.8 GB on
// every replica) but one at a time as they apply, so decoding and walking
// one allocates its ids and sequence hashes: about its own size at most,
// rounded up to the allocator's size classes. The bound of 8 bytes per
// entry byte leaves room for that rounding and refuses the 44.
func TestDecodingABookEntryAllocatesAboutItsSize(t *testing.T) {
	const n = 1 << 17
	entries := map[string][]bookOp{
		"prefill done, empty ids": {{kind: bookPrefillDone}},
		"frees of 2-byte ids":     {{kind: bookFree, b: Booking{ID: "r1"}}},
		"output blocks":           {{kind: bookOutput, b: Booking{ID: "r", SeqHashes: []uint64{7}}}},
		"adds":                    {{kind: bookAdd, b: Booking{ID: "r", Rank: kvevent.Rank{Worker: 1}, SeqHashes: []uint64{1, 2}, ISL: 5}}},
	}
	for name, op := range entries {
		data := encodeBook(1, slices.Repeat(op, n))
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		c, err := decodeCommand(data)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		ops := 0
		for range c.books.all() {
			ops++
		}
		runtime.ReadMemStats(&after)
		if ops != n {
			t.Fatalf("%s: %d operations decoded, want %d", name, ops, n)
		}
		alloc := after.TotalAlloc - before.TotalAlloc
		per := float64(alloc) / float64(len(data))
		t.Logf("%s: an entry of %d bytes allocates %d bytes decoded and walked (%.1f per entry byte)", name, len(data), alloc, per)
		if per > 8 {
			t.Errorf("%s: decoding and walking a %d-byte book entry allocates %d bytes: %.1f bytes per entry byte, want at most 8", name, len(data), alloc, per)
		}
	}
}

// BenchmarkDecodeCommand decodes the entries the apply path sees most, as
// ApplyBatch does: a route's booking (one add), an output block with its
// decay (a book entry's operations walked as the apply walks them), and
// an event-plane entry of 150 events into a warm scratch.
func BenchmarkDecodeCommand(b *testing.B) {
	sink := 0
	hashes := make([]uint64, 32)
	for i := range hashes {
		hashes[i] = uint64(i)*0x9e3779b97f4a7c15 + 1
	}
	id := "0b5c6a4e-6f2d-4d1e-9a57-3c2f0e8d7b1a"
	var batches []RankBatch
	for w := uint64(1); w <= 3; w++ {
		r := kvevent.Rank{Worker: w, DP: 1}
		rb := RankBatch{Rank: r, Incarnation: w}
		for i := range 50 {
			rb.Events = append(rb.Events, kvevent.Event{Rank: r, EventID: uint64(i + 1), Kind: kvevent.KindStored, HasParent: i > 0, Parent: uint64(i),
				Blocks: []kvevent.Block{{EngineHash: uint64(i), LocalHash: uint64(i) + 7}, {EngineHash: uint64(i) + 1, LocalHash: uint64(i) + 8}}})
		}
		batches = append(batches, rb)
	}
	for _, bc := range []struct {
		name string
		data []byte
	}{
		{"book-add", encodeBook(1, []bookOp{{kind: bookAdd, b: Booking{ID: id, Rank: kvevent.Rank{Worker: 3, DP: 1}, SeqHashes: hashes, ISL: 512, CachedTokens: 128}}})},
		{"book-output-decay", encodeBook(1, []bookOp{{kind: bookOutput, b: Booking{ID: id, SeqHashes: hashes[:1]}}, {kind: bookDecay, b: Booking{ID: id, Discount: 1000}}})},
		{"events-150", encodeEvents(1, batches)},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var sc decodeScratch
			b.ReportAllocs()
			b.SetBytes(int64(len(bc.data)))
			for b.Loop() {
				sc.reset()
				c, err := decodeCommandInto(bc.data, &sc)
				if err != nil {
					b.Fatal(err)
				}
				for op := range c.books.all() { // as the apply walks them
					sink += len(op.b.ID) + len(op.b.SeqHashes)
				}
			}
		})
	}
	_ = sink
}

// TestASettingsEntryOfAnUnknownViewIsRefused pins that a settings entry
// (and the settings record, which is its payload) naming a view this
// build does not know is refused, not misread: docs/operations.md
// ("Upgrade") says "a node refuses a version it does not know rather
// than misreading it". The API takes only dedup and tiered
// (api/validate.go), so a later view can only come from a later build's
// leader; the decoder took any byte, and the node scored by dedup (the
// String and the lookups treat every view but tiered as dedup) and
// reported "dedup", while the nodes that know the view scored by it.
func TestASettingsEntryOfAnUnknownViewIsRefused(t *testing.T) {
	s := Settings{Params: indexer.DefaultParams(), View: indexer.ViewTiered + 1}
	b := encodeSettings(9, &s)
	if c, err := decodeCommand(b); !errors.Is(err, ErrBadCommand) {
		t.Fatalf("a settings entry of view %d decoded as view %q, err %v; want ErrBadCommand", s.View, c.settings.View, err)
	}
	var e enc
	encodeSettingsValue(&e, &s)
	if got, err := decodeSettingsValue(e.b); err == nil {
		t.Fatalf("a settings record of view %d decoded as view %q; want an error", s.View, got.View)
	}
}

// TestEntriesOfALaterBuildAreToldFromGarbledOnes pins which undecodable
// entries are a later build's (ErrLaterBuild: the FSM halts at them
// until the node is upgraded) and which are garbled (ErrBadCommand
// alone: skipped): a version above the highest this build reads, a
// command type, a settings view or a worker extension it does not know,
// each in full-length bytes, against truncations and a version below 1.
// The worker record in the state decodes as the entry's worker does, and
// the settings record as the entry's settings.
func TestEntriesOfALaterBuildAreToldFromGarbledOnes(t *testing.T) {
	w := WorkerInfo{ID: 7, DPRanks: []uint32{0}, BlockSize: 16, Endpoint: "e", Model: "m", Tenant: "t"}
	reg := encodeRegister(5, &w)
	var we enc
	encodeWorker(&we, &w)
	ext := len(reg) - len(we.b) + bytes.LastIndexByte(we.b, 'm') + 1 // the extension byte, after the model
	if reg[ext] != 1 {
		t.Fatalf("byte %d of %x is %d, not extension 1", ext, reg, reg[ext])
	}
	ext2 := bytes.Clone(reg)
	ext2[ext] = 2
	later := bytes.Clone(reg)
	later[0] = commandVersion + 1
	var typ enc
	encodeHeader(&typ, cmdRemoveRanks+1, 5)
	typ.uv(0)
	view := encodeSettings(5, &Settings{Params: indexer.DefaultParams(), View: indexer.ViewTiered + 1})
	for name, b := range map[string][]byte{"a later version": later, "a later type": typ.b,
		"a later settings view": view, "a later worker extension": ext2} {
		if _, err := decodeCommand(b); !errors.Is(err, ErrLaterBuild) || !errors.Is(err, ErrBadCommand) {
			t.Errorf("%s: %v, want ErrLaterBuild (and ErrBadCommand)", name, err)
		}
	}
	ext0 := bytes.Clone(reg)
	ext0[ext] = 0
	version0 := bytes.Clone(reg)
	version0[0] = 0
	for name, b := range map[string][]byte{"empty": nil, "a version 0": version0, "a type without its time": {commandVersion, 99},
		"a worker extension 0": ext0, "a truncated registration": reg[:len(reg)-1], "a truncated settings entry": view[:len(view)-1]} {
		if _, err := decodeCommand(b); !errors.Is(err, ErrBadCommand) || errors.Is(err, ErrLaterBuild) {
			t.Errorf("%s: %v, want ErrBadCommand, not ErrLaterBuild", name, err)
		}
	}
	d := dec{b: ext2[len(ext2)-len(we.b):]} // the worker, as its record holds it
	if decodeWorker(&d); !errors.Is(d.done(), ErrLaterBuild) {
		t.Errorf("a worker record of extension 2: %v, want ErrLaterBuild", d.err)
	}
	var se enc
	encodeSettingsValue(&se, &Settings{Params: indexer.DefaultParams(), View: indexer.ViewTiered + 1})
	if _, err := decodeSettingsValue(se.b); !errors.Is(err, ErrLaterBuild) {
		t.Errorf("a settings record of a later view: %v, want ErrLaterBuild", err)
	}
}

// TestAStateWithASettingsRecordOfALaterBuildIsNotOpened: a state whose
// settings record names a view this build does not know (a later build
// ran on it) is refused at open, the error naming the record, rather
// than opened and scored by dedup.
func TestAStateWithASettingsRecordOfALaterBuildIsNotOpened(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "fsm")
	f := openTestFSM(t, dir)
	var w logWriter
	f.ApplyBatch([]*raft.Log{w.next(encodeSettings(5, &Settings{Params: indexer.DefaultParams(), View: indexer.ViewTiered}))})
	var e enc
	encodeSettingsValue(&e, &Settings{Params: indexer.DefaultParams(), View: indexer.ViewTiered + 1})
	f.batch.Put(store.KindSettings, []byte{'s'}, e.b) // as a later build's apply would have
	snap := snapshotBytes(t, f)
	f.Close()
	g, err := OpenFSM(FSMConfig{Dir: dir, Logger: quiet})
	if err == nil {
		g.Close()
		t.Fatalf("opened a state whose settings are of view %d, as view %q", indexer.ViewTiered+1, g.Settings().View)
	}
	if !errors.Is(err, ErrLaterBuild) || strings.Count(err.Error(), "settings record") != 1 {
		t.Fatalf("open: %v, want ErrLaterBuild naming the settings record once", err)
	}
	// A restore of a snapshot holding it refuses the snapshot, naming the
	// record once.
	h := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer h.Close()
	err = h.Restore(io.NopCloser(bytes.NewReader(snap)))
	if !errors.Is(err, ErrBadSnapshot) || !strings.Contains(err.Error(), "written by a later build") || strings.Count(err.Error(), "settings record") != 1 {
		t.Fatalf("restore: %v, want ErrBadSnapshot naming the settings record of a later build once", err)
	}
}

// TestARegistrationWhosePositionalByteNoBuildWritesIsRefused pins that a
// worker's positional flag, the last byte of its extension 1, decodes
// only from the bytes encodeWorker writes for it (0 or 1): any other
// byte is refused (ErrBadCommand), in an entry and in the worker's state
// record alike, as "a decoder rejects anything it does not fully
// understand" (command.go) and "a node refuses ... rather than misreading
// it" (docs/operations.md, Upgrade). Read as "== 1", a 2 (a later build's
// widened flag, or damage) registered the worker as non-Positional, with
// the other registration rules (droppedRanks), on this build only.
func TestARegistrationWhosePositionalByteNoBuildWritesIsRefused(t *testing.T) {
	w := WorkerInfo{ID: 7, DPRanks: []uint32{0, 1}, BlockSize: 16, Endpoint: "e", Model: "m", Positional: true}
	reg := encodeRegister(5, &w)
	if reg[len(reg)-1] != 1 {
		t.Fatalf("the registration %x does not end with its positional byte 1", reg)
	}
	for _, v := range []byte{2, 3, 0xff} {
		b := bytes.Clone(reg)
		b[len(b)-1] = v
		if c, err := decodeCommand(b); !errors.Is(err, ErrBadCommand) {
			t.Errorf("a registration whose positional byte is %d decoded (positional %v), err %v; want ErrBadCommand",
				v, c.worker.Positional, err)
		}
		var we enc
		encodeWorker(&we, &w)
		we.b[len(we.b)-1] = v
		d := dec{b: we.b}
		got := decodeWorker(&d)
		if err := d.done(); !errors.Is(err, ErrBadCommand) {
			t.Errorf("a worker record whose positional byte is %d decoded (positional %v), err %v; want ErrBadCommand",
				v, got.Positional, err)
		}
	}
}

// TestABookingKindOfALaterBuildHaltsTheFSM pins that a booking entry
// whose operation kind is above the highest this build knows (bookDecay)
// is a later build's (ErrLaterBuild): the FSM halts at it, its applied
// index staying at the entry before, as at a later version or command
// type, where it was skipped as garbled and a node of this build went out
// of step with the upgraded ones for good (booking kinds are added
// without a version bump). A kind 0, no build's, stays garbled: skipped.
func TestABookingKindOfALaterBuildHaltsTheFSM(t *testing.T) {
	later := encodeBook(5, []bookOp{{kind: bookDecay + 1, b: Booking{ID: "q"}}})
	if _, err := decodeCommand(later); !errors.Is(err, ErrLaterBuild) {
		t.Errorf("a booking kind %d: %v, want ErrLaterBuild", bookDecay+1, err)
	}
	kind0 := encodeBook(5, []bookOp{{kind: 0, b: Booking{ID: "q"}}})
	if _, err := decodeCommand(kind0); !errors.Is(err, ErrBadCommand) || errors.Is(err, ErrLaterBuild) {
		t.Errorf("a booking kind 0: %v, want ErrBadCommand, not ErrLaterBuild", err)
	}
	f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
	defer f.Close()
	var w logWriter
	res := f.ApplyBatch([]*raft.Log{w.next(encodeRegister(5, &WorkerInfo{ID: 1, BlockSize: 16})), w.next(kind0), w.next(later),
		w.next(encodeRegister(5, &WorkerInfo{ID: 2, BlockSize: 16}))})
	var h *ApplyHalt
	if err, ok := res[2].(error); !ok || !errors.As(err, &h) || h.Index != 3 {
		t.Fatalf("the entry of a later booking kind: %v, want the halt at entry 3 (ErrLaterBuild)", res[2])
	}
	if got := f.applied.Load(); got != 2 {
		t.Fatalf("applied index %d after the halt, want 2, the entry before it", got)
	}
}

// TestAnEventKindOrTierOfALaterBuildHaltsTheFSM pins that an event batch
// or a rank dump holding an event of a kind above the highest this build
// knows (KindCleared), or of a tier it does not know, is a later build's
// entry (ErrLaterBuild): a node validates every event before it proposes
// it, so no build writes such an event but one that reads it. The FSM
// halts at it, where it skipped the entry as garbled and a node of this
// build went without the later build's events for good. A kind 0, no
// build's, stays garbled: skipped.
func TestAnEventKindOrTierOfALaterBuildHaltsTheFSM(t *testing.T) {
	r := kvevent.Rank{Worker: 1}
	store := kvevent.Event{EventID: 1, Kind: kvevent.KindStored, Blocks: []kvevent.Block{{EngineHash: 1, LocalHash: 1}}}
	later := map[string][]byte{}
	for name, ev := range map[string]kvevent.Event{
		"kind": {EventID: 1, Kind: kvevent.KindCleared + 1},
		"tier": {EventID: 1, Kind: kvevent.KindStored, Tier: kvevent.NumTiers, Blocks: store.Blocks},
	} {
		later["an event batch of a later "+name] = encodeEvents(5, []RankBatch{{Rank: r, Events: []kvevent.Event{ev}}})
		later["a rank dump of a later "+name] = encodeReplace(5, r, 1, 0, []kvevent.Event{ev})
	}
	for name, b := range later {
		if _, err := decodeCommand(b); !errors.Is(err, ErrLaterBuild) {
			t.Errorf("%s: %v, want ErrLaterBuild", name, err)
		}
	}
	kind0 := encodeEvents(5, []RankBatch{{Rank: r, Events: []kvevent.Event{{EventID: 1}}}})
	if _, err := decodeCommand(kind0); !errors.Is(err, ErrBadCommand) || errors.Is(err, ErrLaterBuild) {
		t.Errorf("an event of kind 0: %v, want ErrBadCommand, not ErrLaterBuild", err)
	}
	for name, b := range later {
		t.Run(name, func(t *testing.T) {
			f := openTestFSM(t, filepath.Join(t.TempDir(), "fsm"))
			defer f.Close()
			var w logWriter
			res := f.ApplyBatch([]*raft.Log{w.next(encodeRegister(5, &WorkerInfo{ID: 1, DPRanks: []uint32{0}, BlockSize: 16})),
				w.next(kind0), w.next(b), w.next(encodeEvents(5, []RankBatch{{Rank: r, Events: []kvevent.Event{store}}}))})
			var h *ApplyHalt
			if err, ok := res[2].(error); !ok || !errors.As(err, &h) || h.Index != 3 {
				t.Fatalf("the entry: %v, want the halt at entry 3 (ErrLaterBuild)", res[2])
			}
			if got := f.applied.Load(); got != 2 {
				t.Fatalf("applied index %d after the halt, want 2, the entry before it", got)
			}
		})
	}
}

// TestCountsLargerThanTheirBytesAreRefused pins dec.count's check of a
// count against the bytes left (at its least bytes an element): a Raft
// command or a snapshot record whose count claims more elements than its
// bytes can hold (a million, after a valid prefix and nothing else) fails
// as a bad count, at once, without allocating from the count: every case
// passed as an error of the element's read, after allocating for, or
// looping over, the million, with the check turned off.
func TestCountsLargerThanTheirBytesAreRefused(t *testing.T) {
	const forged = 1 << 20
	cmd := func(typ cmdType, body func(e *enc)) []byte {
		var e enc
		encodeHeaderV(&e, commandVersion, typ, 1)
		body(&e)
		return e.b
	}
	rank := func(e *enc) { e.uv(7); e.uv(1) }
	meta := func(e *enc) {
		for range kvevent.NumTiers {
			e.sv(100)
		}
		e.uv(0)
		e.bool(false)
		e.bool(false)
	}
	var sc decodeScratch
	for _, c := range []struct {
		name, what string
		decode     func() error
	}{
		{"event batches", "batches", func() error {
			_, err := decodeCommandInto(cmd(cmdEvents, func(e *enc) { e.uv(forged) }), &sc)
			return err
		}},
		{"a batch's events", "events", func() error {
			_, err := decodeCommandInto(cmd(cmdEvents, func(e *enc) { e.uv(1); rank(e); e.u64(1); e.uv(forged) }), &sc)
			return err
		}},
		{"a store's blocks", "blocks", func() error {
			_, err := decodeCommandInto(cmd(cmdEvents, func(e *enc) {
				e.uv(1)
				rank(e)
				e.u64(1)
				e.uv(1)
				e.uv(1)
				e.u8(uint8(kvevent.KindStored))
				e.u8(uint8(kvevent.TierDevice))
				e.bool(false)
				e.uv(forged)
			}), &sc)
			return err
		}},
		{"a remove's hashes", "removed", func() error {
			_, err := decodeCommandInto(cmd(cmdEvents, func(e *enc) {
				e.uv(1)
				rank(e)
				e.u64(1)
				e.uv(1)
				e.uv(1)
				e.u8(uint8(kvevent.KindRemoved))
				e.u8(uint8(kvevent.TierDevice))
				e.uv(forged)
			}), &sc)
			return err
		}},
		{"a dump's stored events", "stored", func() error {
			_, err := decodeCommandInto(cmd(cmdReplace, func(e *enc) { rank(e); e.uv(0); e.u64(1); e.uv(forged) }), &sc)
			return err
		}},
		{"a registration's dp ranks", "dp ranks", func() error {
			_, err := decodeCommandInto(cmd(cmdRegister, func(e *enc) { e.uv(7); e.uv(forged) }), &sc)
			return err
		}},
		{"removed ranks", "ranks", func() error {
			_, err := decodeCommandInto(cmd(cmdRemoveRanks, func(e *enc) { e.uv(forged) }), &sc)
			return err
		}},
		{"booking operations", "bookings", func() error {
			_, err := decodeCommandInto(cmd(cmdBook, func(e *enc) { e.uv(forged) }), &sc)
			return err
		}},
		{"a booking's ids", "seq hashes", func() error {
			_, err := decodeCommandInto(cmd(cmdBook, func(e *enc) { e.uv(1); e.u8(uint8(bookAdd)); e.str("r1"); rank(e); e.uv(forged) }), &sc)
			return err
		}},
		{"a check's servers", "check configuration servers", func() error {
			_, err := decodeCommandInto(cmd(cmdCheck, func(e *enc) { e.uv(1); e.u64(2); e.uv(3); e.uv(forged) }), &sc)
			return err
		}},
		{"a booking record's ids", "seq hashes", func() error {
			var e enc
			rank(&e)
			e.uv(forged)
			_, err := decodeBooking("r1", e.b)
			return err
		}},
		{"a rank meta record's orphans", "orphans", func() error {
			var e enc
			meta(&e)
			e.uv(forged)
			_, err := decodeRankMeta(e.b, kvevent.Rank{Worker: 7})
			return err
		}},
		{"an orphan's blocks", "orphan blocks", func() error {
			var e enc
			meta(&e)
			e.uv(1)
			e.sv(1)
			e.u8(uint8(kvevent.TierDevice))
			e.u64(9)
			e.uv(forged)
			_, err := decodeRankMeta(e.b, kvevent.Rank{Worker: 7})
			return err
		}},
		{"a worker record's dp ranks", "dp ranks", func() error {
			var e enc
			e.uv(7)
			e.uv(forged)
			d := dec{b: e.b}
			decodeWorker(&d)
			return d.done()
		}},
	} {
		runtime.GC()
		var ms0, ms1 runtime.MemStats
		runtime.ReadMemStats(&ms0)
		err := c.decode()
		runtime.ReadMemStats(&ms1)
		if want := "invalid " + c.what + " count"; err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: a count of %d with no bytes after it: %v, want an error of %q", c.name, forged, err, want)
		}
		if grown := ms1.TotalAlloc - ms0.TotalAlloc; grown > 64<<10 {
			t.Errorf("%s: a count of %d with no bytes after it allocated %d bytes", c.name, forged, grown)
		}
	}
}

// The settings command and the settings record (the state database's and
// a snapshot's store.KindSettings value under 's') as this build and the
// ones before it write them: encodeSettings(44, settingsFixture) and its
// value after the command's header. Each field has its own value, so a
// field written or read in another position fails.
const (
	settingsCommandHex = "010758" + settingsRecordHex
	settingsRecordHex  = "000000000000f83f" + // overlap_score_credit 1.5
		"000000000000e83f" + // host_cache_hit_weight 0.75
		"000000000000d03f" + // disk_cache_hit_weight 0.25
		"0000000000000040" + // prefill_load_scale 2
		"0000000000000840" + // decode_active_request_weight 3
		"000000000000e03f" + // temperature 0.5
		"000000000000ec3f" + // busy_decode_fraction 0.875
		"8040" + // busy_prefill_tokens 4096 (zigzag varint)
		"01" // view: tiered
)

var settingsFixture = Settings{Params: indexer.Params{OverlapScoreCredit: 1.5, HostCacheHitWeight: 0.75, DiskCacheHitWeight: 0.25,
	PrefillLoadScale: 2, DecodeActiveRequestWeight: 3, Temperature: 0.5, BusyDecodeFraction: 0.875, BusyPrefillTokens: 4096},
	View: indexer.ViewTiered}

// TestSettingsLayoutIsPinned pins the byte layout of the settings command
// (a Raft log holds it) and of the settings record (the state database
// and every snapshot file hold it): both decode to the fixture's fields,
// each in its place, and this build writes them byte for byte.
func TestSettingsLayoutIsPinned(t *testing.T) {
	cmd, err := hex.DecodeString(settingsCommandHex)
	if err != nil {
		t.Fatal(err)
	}
	if got := encodeSettings(44, &settingsFixture); !bytes.Equal(got, cmd) {
		t.Fatalf("the settings command written as\n%x\nwant\n%x", got, cmd)
	}
	c, err := decodeCommand(cmd)
	if err != nil {
		t.Fatalf("the settings command: %v", err)
	}
	if c.typ != cmdSettings || c.now != 44 || c.settings != settingsFixture {
		t.Fatalf("the settings command decoded as type %d at %d, %+v; want %+v", c.typ, c.now, c.settings, settingsFixture)
	}

	rec, err := hex.DecodeString(settingsRecordHex)
	if err != nil {
		t.Fatal(err)
	}
	var e enc
	encodeSettingsValue(&e, &settingsFixture)
	if !bytes.Equal(e.b, rec) {
		t.Fatalf("the settings record written as\n%x\nwant\n%x", e.b, rec)
	}
	s, err := decodeSettingsValue(rec)
	if err != nil || s != settingsFixture {
		t.Fatalf("the settings record decoded as %+v, %v; want %+v", s, err, settingsFixture)
	}
}
