package store

import (
	"encoding/binary"
	"errors"
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
	"github.com/hashicorp/raft"
)

var crashSeed = flag.Uint64("store.crash-seed", 0, "seed of the crash tests; 0 picks one from the clock")

func crashTestSeed(t *testing.T) uint64 {
	seed := *crashSeed
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	t.Logf("seed %d (rerun with -store.crash-seed=%d)", seed, seed)
	return seed
}

// smallMemtables makes Pebble flush and compact constantly, so crash points
// land in the middle of background flushes and compactions too.
func smallMemtables(o *pebble.Options) {
	o.MemTableSize = 256 << 10
	o.L0CompactionThreshold = 2
	o.L0StopWritesThreshold = 64
}

func openCrashStore(t *testing.T, fs vfs.FS) *LogStore {
	t.Helper()
	s, err := OpenLogStore("raft", LogStoreOptions{FS: noReuseFS{fs}, Logger: logStoreTestLogger(t), tune: smallMemtables})
	if err != nil {
		t.Fatalf("open log store: %v", err)
	}
	return s
}

// noReuseFS recycles a WAL file by removing it and creating the new one,
// which ReuseForWrite's contract allows. Pebble's crashable MemFS
// (v2.1.7) takes its clone lock for reading in ReuseForWrite and again in
// the Rename it calls: a CrashClone waiting between the two deadlocks
// them all (seen once on CI, the whole package hung until its timeout).
type noReuseFS struct{ vfs.FS }

func (f noReuseFS) ReuseForWrite(oldname, newname string, category vfs.DiskWriteCategory) (vfs.File, error) {
	if err := f.FS.Remove(oldname); err != nil {
		return nil, err
	}
	return f.FS.Create(newname, category)
}

// crashLog is the entry a crash workload stores at index in term. Its payload
// (0..2 KiB) is a function of both, so a reader can check any entry it finds
// without the writer's help, and a stale term can never pass for a new one.
func crashLog(index, term uint64) *raft.Log {
	var seed [32]byte
	binary.LittleEndian.PutUint64(seed[:], index)
	binary.LittleEndian.PutUint64(seed[8:], term)
	rng := rand.NewChaCha8(seed)
	data := make([]byte, 1+(index*7919+term*104729)%(2<<10))
	_, _ = rng.Read(data)
	return &raft.Log{Index: index, Term: term, Type: raft.LogCommand, Data: data,
		AppendedAt: time.Unix(int64(index), int64(term)).UTC()}
}

// crashLogState is what a store holds, as the tests compare it: the log bounds,
// the term of every entry between them, and the stable keys.
type crashLogState struct {
	first, last uint64
	terms       []uint64 // terms[i-first] is the term of index i
	stable      map[string]string
}

func (m crashLogState) clone() crashLogState {
	m.terms = append([]uint64(nil), m.terms...)
	m.stable = maps.Clone(m.stable)
	return m
}

func (m crashLogState) equal(o crashLogState) bool {
	if m.first != o.first || m.last != o.last || len(m.terms) != len(o.terms) || !maps.Equal(m.stable, o.stable) {
		return false
	}
	for i := range m.terms {
		if m.terms[i] != o.terms[i] {
			return false
		}
	}
	return true
}

func (m crashLogState) String() string {
	return fmt.Sprintf("log [%d, %d] (%d entries), stable %q", m.first, m.last, len(m.terms), m.stable)
}

var crashStableKeys = []string{"CurrentTerm", "LastVoteTerm", "LastVoteCand"}

// crashWorkload applies raft-shaped operations to a store and to a model of
// what the store must hold once each operation has been acknowledged.
type crashWorkload struct {
	rng   *rand.Rand
	s     *LogStore
	model crashLogState
	term  uint64
	next  uint64 // index of the next append
}

func newCrashWorkload(rng *rand.Rand, s *LogStore) *crashWorkload {
	return &crashWorkload{rng: rng, s: s, term: 1, next: 1, model: crashLogState{stable: map[string]string{}}}
}

// step applies one random operation; when it returns nil the model holds
// the state the store acknowledged.
func (w *crashWorkload) step() error {
	m := &w.model
	n := uint64(len(m.terms))
	switch p := w.rng.IntN(100); {
	case p < 10 && n > 0 || n > 1000: // compact the head, as after a snapshot
		max := m.first + w.rng.Uint64N(n)
		if err := w.s.DeleteRange(m.first, max); err != nil {
			return err
		}
		m.terms = m.terms[max-m.first+1:]
		m.first = max + 1
	case p < 18 && n > 0: // truncate a conflicting tail; a new leader appends in a new term
		min := m.first + w.rng.Uint64N(n)
		if err := w.s.DeleteRange(min, m.last); err != nil {
			return err
		}
		m.terms = m.terms[:min-m.first]
		m.last = min - 1
		w.next = min
		w.term++
	case p < 24:
		k := crashStableKeys[w.rng.IntN(2)]
		if err := w.s.SetUint64([]byte(k), w.term); err != nil {
			return err
		}
		m.stable[k] = string(crashUint64Bytes(w.term))
	case p < 28:
		v := fmt.Sprintf("node-%d", w.rng.IntN(5))
		if err := w.s.Set([]byte("LastVoteCand"), []byte(v)); err != nil {
			return err
		}
		m.stable["LastVoteCand"] = v
	default: // append a group of entries
		count := 1 + w.rng.Uint64N(64)
		logs := make([]*raft.Log, 0, count)
		for i := range count {
			logs = append(logs, crashLog(w.next+i, w.term))
		}
		if err := w.s.StoreLogs(logs); err != nil {
			return err
		}
		if len(m.terms) == 0 {
			m.first = w.next
		}
		for range count {
			m.terms = append(m.terms, w.term)
		}
		w.next += count
		m.last = w.next - 1
	}
	if len(m.terms) == 0 {
		m.first, m.last = 0, 0
	}
	return nil
}

func crashUint64Bytes(v uint64) []byte { return binary.BigEndian.AppendUint64(nil, v) }

// readState reopens a crashed filesystem and reads back everything the
// store holds, failing the test on a hole between FirstIndex and LastIndex,
// an entry whose payload is not the one written at its index and term, or an
// entry outside the bounds.
func readState(t *testing.T, fs vfs.FS) crashLogState {
	t.Helper()
	s := openCrashStore(t, fs)
	defer func() {
		if err := s.Close(); err != nil {
			t.Errorf("close crashed store: %v", err)
		}
	}()
	var st crashLogState
	st.first, _ = s.FirstIndex()
	st.last, _ = s.LastIndex()
	if (st.first == 0) != (st.last == 0) || st.first > st.last {
		t.Fatalf("after crash: bounds [%d, %d] are inconsistent", st.first, st.last)
	}
	if st.last != 0 {
		for i := st.first; i <= st.last; i++ {
			var l raft.Log
			if err := s.GetLog(i, &l); err != nil {
				t.Fatalf("after crash: hole at index %d in [%d, %d]: %v", i, st.first, st.last, err)
			}
			if want := crashLog(i, l.Term); !logsEqual(&l, want) {
				t.Fatalf("after crash: entry %d (term %d) is not what was written", i, l.Term)
			}
			st.terms = append(st.terms, l.Term)
		}
		var l raft.Log
		for _, i := range []uint64{st.first - 1, st.last + 1} {
			if err := s.GetLog(i, &l); err != raft.ErrLogNotFound {
				t.Fatalf("after crash: GetLog(%d) outside [%d, %d] = %v, want ErrLogNotFound", i, st.first, st.last, err)
			}
		}
	}
	st.stable = map[string]string{}
	for _, k := range crashStableKeys {
		v, err := s.Get([]byte(k))
		switch {
		case err == nil:
			st.stable[k] = string(v)
		case err != ErrKeyNotFound:
			t.Fatalf("after crash: Get(%s): %v", k, err)
		}
	}
	return st
}

// TestCrashAfterAcknowledgedWritesLosesNothing runs the workload and, at
// random points between operations, takes a crash image of the filesystem
// (keeping a random share of whatever Pebble wrote without syncing: torn
// flushes and compactions). Every acknowledged write was synced, so the image
// must reopen to exactly the model: nothing acknowledged is missing and
// nothing deleted comes back.
func TestCrashAfterAcknowledgedWritesLosesNothing(t *testing.T) {
	rng := rand.New(rand.NewPCG(crashTestSeed(t), 1))
	fs := vfs.NewCrashableMem()
	s := openCrashStore(t, fs)
	defer func() { _ = s.Close() }()
	w := newCrashWorkload(rng, s)

	const ops, crashes = 250, 8
	crashAt := map[int]bool{ops - 1: true}
	for len(crashAt) < crashes {
		crashAt[rng.IntN(ops)] = true
	}
	for op := range ops {
		if err := w.step(); err != nil {
			t.Fatalf("op %d: %v", op, err)
		}
		if !crashAt[op] {
			continue
		}
		unsynced := []int{0, 10, 50, 90, 100}[rng.IntN(5)]
		crashed := fs.CrashClone(vfs.CrashCloneCfg{UnsyncedDataPercent: unsynced, RNG: rand.New(rand.NewPCG(rng.Uint64(), 2))})
		got := readState(t, crashed)
		if !got.equal(w.model) {
			t.Fatalf("crash after op %d (unsynced data kept: %d%%):\n  got  %v\n  want %v", op, unsynced, got, w.model)
		}
	}
}

// TestCrashDuringWritesKeepsAPrefixOfOperations takes crash images while a
// writer is in the middle of its operations. Each operation is one synced
// batch, so an image must equal the state after some operation k, where k is
// at least the number acknowledged before the image was taken and at most
// the number started by the time it was done.
func TestCrashDuringWritesKeepsAPrefixOfOperations(t *testing.T) {
	seed := crashTestSeed(t)
	fs := vfs.NewCrashableMem()
	s := openCrashStore(t, fs)
	defer func() { _ = s.Close() }()
	w := newCrashWorkload(rand.New(rand.NewPCG(seed, 1)), s)

	const ops = 250
	history := []crashLogState{w.model.clone()} // history[k]: state after k ops
	var started, acked atomic.Int64
	var wg sync.WaitGroup
	var writeErr error
	wg.Go(func() {
		for k := 1; k <= ops; k++ {
			started.Store(int64(k))
			if err := w.step(); err != nil {
				writeErr = fmt.Errorf("op %d: %w", k, err)
				return
			}
			history = append(history, w.model.clone())
			acked.Store(int64(k))
		}
	})

	type image struct {
		fs       *vfs.MemFS
		lo, hi   int64
		unsynced int
	}
	var images []image
	rng := rand.New(rand.NewPCG(seed, 3))
	// Crash points: a random operation to land in, then a random number of
	// spins so that the image is taken at a random moment inside it.
	targets := make([]int64, 12)
	for i := range targets {
		targets[i] = 1 + rng.Int64N(ops)
	}
	slices.Sort(targets)
	for _, target := range targets {
		for started.Load() < target && acked.Load() < ops {
			runtime.Gosched()
		}
		for range rng.IntN(20_000) {
			crashSpin.Add(1)
		}
		unsynced := []int{0, 30, 70, 100}[rng.IntN(4)]
		lo := acked.Load()
		crashed := fs.CrashClone(vfs.CrashCloneCfg{UnsyncedDataPercent: unsynced, RNG: rand.New(rand.NewPCG(rng.Uint64(), 4))})
		images = append(images, image{fs: crashed, lo: lo, hi: started.Load(), unsynced: unsynced})
	}
	wg.Wait()
	if writeErr != nil {
		t.Fatal(writeErr)
	}
	for i, img := range images {
		got := readState(t, img.fs)
		ok := false
		for k := img.lo; k <= img.hi && !ok; k++ {
			ok = got.equal(history[k])
		}
		if !ok {
			t.Fatalf("crash image %d (unsynced data kept: %d%%) matches no state after ops %d..%d:\n  got        %v\n  after %4d %v",
				i, img.unsynced, img.lo, img.hi, got, img.lo, history[img.lo])
		}
	}
	t.Logf("%d crash images checked", len(images))
}

// crashSpin is a sink for the crash tests' busy-wait jitter.
var crashSpin atomic.Int64

// TestCrashImageOfFreshStoreOpens covers the smallest window: a crash right
// after the database was created, before any log write.
func TestCrashImageOfFreshStoreOpens(t *testing.T) {
	fs := vfs.NewCrashableMem()
	s := openCrashStore(t, fs)
	defer func() { _ = s.Close() }()
	got := readState(t, fs.CrashClone(vfs.CrashCloneCfg{}))
	if !got.equal(crashLogState{stable: map[string]string{}}) {
		t.Fatalf("fresh store after crash = %v, want empty", got)
	}
	if _, err := s.Get([]byte("x")); !errors.Is(err, ErrKeyNotFound) {
		t.Fatalf("Get on the original after a crash clone = %v", err)
	}
}
