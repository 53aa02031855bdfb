package pool

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cockroachdb/pebble/v2"

	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/kvevent"
)

const internalBlock = 64

func openInternal(t *testing.T, dir string, log *testlog.Buffer) *DiskPool {
	t.Helper()
	return openIdentity(t, dir, log, "")
}

// openIdentity is openInternal for a pool of the given identity.
func openIdentity(t *testing.T, dir string, log *testlog.Buffer, identity string) *DiskPool {
	t.Helper()
	cfg := Config{Capacity: 8, BlockSize: internalBlock}
	if log != nil {
		cfg.Logger = slog.New(slog.NewTextHandler(log, nil))
	}
	p, err := OpenDisk(dir, cfg, DiskOptions{Identity: identity})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() }) // after a failure; a second Close is a no-op
	return p
}

func blockBytes(h uint64) []byte { return bytes.Repeat([]byte{byte(h)}, internalBlock) }

// writeGarbage stores, next to the valid blocks 1 and 2 (2 a child of 1),
// entries that a reopened pool cannot use: a block of hash 0, a block that
// is its own parent, metadata without bytes, and keys of the wrong length
// in the metadata and bytes ranges (one starting with block 1's key). It
// returns the keys of the valid blocks, the header and the identity, in key
// order.
func writeGarbage(t *testing.T, dir string) [][]byte {
	t.Helper()
	p := openInternal(t, dir, nil)
	if n, err := p.Put([]Block{{Hash: 1, Local: 11}, {Hash: 2, Parent: 1, Local: 22}},
		[][]byte{blockBytes(1), blockBytes(2)}); n != 2 || err != nil {
		t.Fatalf("put: %d, %v", n, err)
	}
	b := p.db.NewBatch()
	b.Set(hashKey(kindMeta, 0), encodeMeta(Block{Local: 3}, 50), nil)
	b.Set(hashKey(kindData, 0), blockBytes(3), nil)
	b.Set(hashKey(kindMeta, 5), encodeMeta(Block{Hash: 5, Parent: 5, Local: 55}, 51), nil)
	b.Set(hashKey(kindData, 5), blockBytes(5), nil)
	b.Set(hashKey(kindMeta, 7), encodeMeta(Block{Hash: 7, Local: 77}, 52), nil)
	b.Set(append(hashKey(kindMeta, 1), 0xee), encodeMeta(Block{Hash: 9}, 53), nil)
	b.Set([]byte{kindData, 1, 2}, blockBytes(4), nil)
	if err := b.Commit(pebble.NoSync); err != nil {
		t.Fatal(err)
	}
	b.Close()
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	return [][]byte{hashKey(kindData, 1), hashKey(kindData, 2), {kindHeader}, {kindIdent}, hashKey(kindMeta, 1), hashKey(kindMeta, 2)}
}

// keys lists every key in the pool's database, in order.
func keys(t *testing.T, p *DiskPool) [][]byte {
	t.Helper()
	it, err := p.db.NewIter(nil)
	if err != nil {
		t.Fatal(err)
	}
	var ks [][]byte
	for it.First(); it.Valid(); it.Next() {
		ks = append(ks, slices.Clone(it.Key()))
	}
	if err := errors.Join(it.Error(), it.Close()); err != nil {
		t.Fatal(err)
	}
	return ks
}

// checkValid fails unless the pool holds exactly blocks 1 and 2, with their
// parents and bytes.
func checkValid(t *testing.T, p *DiskPool) {
	t.Helper()
	if st := p.Stats(); st.Used != 2 || st.Evictions != 0 {
		t.Fatalf("reopened pool: %+v, want blocks 1 and 2", st)
	}
	evs, _ := p.Dump()
	if len(evs) != 1 || len(evs[0].Blocks) != 2 || evs[0].Blocks[0].EngineHash != 1 || evs[0].Blocks[1].EngineHash != 2 ||
		evs[0].Blocks[0].LocalHash != 11 || evs[0].Blocks[1].LocalHash != 22 || evs[0].HasParent {
		t.Fatalf("reopened pool dumps %+v, want the chain 1 ← 2", evs)
	}
	buf := make([]byte, internalBlock)
	for _, h := range []uint64{1, 2} {
		if err := p.Read(h, buf); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(buf, blockBytes(h)) {
			t.Fatalf("block %d's bytes changed", h)
		}
	}
}

func TestDiskReopenDeletesEntriesThatFailTheirCheckAndKeepsValidOnes(t *testing.T) {
	dir := t.TempDir()
	valid := writeGarbage(t, dir)

	log := &testlog.Buffer{}
	p := openInternal(t, dir, log)
	checkValid(t, p)
	if got := keys(t, p); !slices.EqualFunc(got, valid, bytes.Equal) {
		t.Fatalf("keys after reopening: %x, want only the header, the identity and blocks 1 and 2: %x", got, valid)
	}
	for _, want := range []string{"incomplete=1", "invalid=2", "malformed_keys=2"} {
		if !strings.Contains(log.String(), want) {
			t.Fatalf("the reopen logged %q, without %s", log.String(), want)
		}
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}

	// The deletions last.
	p = openInternal(t, dir, nil)
	checkValid(t, p)
	if got := keys(t, p); !slices.EqualFunc(got, valid, bytes.Equal) {
		t.Fatalf("keys after a second reopen: %x, want %x", got, valid)
	}
}

func TestDiskReopenThatCannotDeleteInvalidEntriesKeepsValidBlocks(t *testing.T) {
	dir := t.TempDir()
	valid := writeGarbage(t, dir)

	testHookDropCommit = func(*pebble.Batch) error { return errors.New("injected delete failure") }
	t.Cleanup(func() { testHookDropCommit = nil })
	log := &testlog.Buffer{}
	p := openInternal(t, dir, log)
	checkValid(t, p)
	if !strings.Contains(log.String(), "injected delete failure") {
		t.Fatalf("the failed deletion was not logged: %q", log.String())
	}
	if got := keys(t, p); len(got) == len(valid) {
		t.Fatal("invalid entries deleted though the deletion failed")
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}

	// The next open deletes them.
	testHookDropCommit = nil
	p = openInternal(t, dir, nil)
	checkValid(t, p)
	if got := keys(t, p); !slices.EqualFunc(got, valid, bytes.Equal) {
		t.Fatalf("keys after the next reopen: %x, want %x", got, valid)
	}
}

// A Register of a block another Put has reserved and not yet committed says
// ErrBusy, as HostPool.Register does: that Put may still fail and leave the
// pool without the block, so "already held" would be a lie.
func TestDiskRegisterOfABlockBeingWrittenSaysBusy(t *testing.T) {
	p := openInternal(t, t.TempDir(), nil)
	b := Block{Hash: 5, Local: 55}
	e, err := p.c.reserve(b) // what a concurrent Put holds until its commit
	if err != nil {
		t.Fatal(err)
	}
	err = p.Register(b, blockBytes(5))
	p.c.abort([]*entry{e}) // the other Put's write failed
	if !errors.Is(err, ErrExists) || !errors.Is(err, ErrBusy) {
		t.Fatalf("Register of a block being written: %v, want ErrExists and ErrBusy", err)
	}
	if st := p.Stats(); st.Used != 0 || st.Revived != 0 {
		t.Fatalf("after the other write failed: %+v, want nothing held or revived", st)
	}
}

// blobRewriteChildEnv, set in the child process of
// TestDiskDamagedBlobFileDoesNotKillTheProcessInABlobRewrite, says which
// policy the child runs: "pool" (the pool's own) or "rewrites" (Pebble's
// blob-file rewrites on, as the pool had them).
const blobRewriteChildEnv = "KVROUTER_TEST_BLOB_REWRITE_CHILD"

// A flipped byte in a live block's bytes in a blob file (bit rot under the
// open pool). Pebble rewrites a blob file whose blocks are mostly evicted
// (the pool had it at 30% garbage and a minute old); the rewrite reads
// every live value, meets the checksum mismatch and reports it with no file
// metadata, which panics ("unknown metadata type: <nil>") on Pebble's
// compaction goroutine, where nothing can recover: the process ended, and
// again after each restart once the rewrite was picked. The pool runs no
// blob-file rewrites now: the damaged block fails its read with ErrCorrupt
// and is dropped, as any other.
//
// Each run is a child process, so that the panic fails the test instead of
// ending the test binary. Rewrites start at once in both (no minimum age);
// the control run, with rewrites on, must die, or the scenario no longer
// reaches a rewrite.
func TestDiskDamagedBlobFileDoesNotKillTheProcessInABlobRewrite(t *testing.T) {
	if mode := os.Getenv(blobRewriteChildEnv); mode != "" {
		blobRewriteChild(t, mode == "rewrites")
		return
	}
	run := func(mode string) (string, error) {
		cmd := exec.Command(os.Args[0], "-test.run=^TestDiskDamagedBlobFileDoesNotKillTheProcessInABlobRewrite$",
			"-test.count=1", "-test.v")
		// The child's temporary directories go under this test's: the
		// control run dies before its own cleanup, and left one in the
		// system's temporary directory at every run.
		cmd.Env = append(os.Environ(), blobRewriteChildEnv+"="+mode, "TMPDIR="+t.TempDir())
		out, err := cmd.CombinedOutput()
		head := string(out)
		if i := strings.Index(head, "\ngoroutine "); i > 0 {
			head = head[:i]
		}
		return head[max(0, len(head)-3000):], err
	}
	out, err := run("pool")
	if err != nil {
		t.Fatalf("the process died (%v):\n%s", err, out)
	}
	if !strings.Contains(out, "--- PASS") {
		t.Fatalf("the child did not pass:\n%s", out)
	}
	out, err = run("rewrites")
	if err == nil || !strings.Contains(out, pebbleBlobOpenPanic) {
		t.Fatalf("the control run, blob rewrites on, did not die of Pebble's panic (err %v): the scenario "+
			"no longer reaches a rewrite, or Pebble no longer panics there (then rewrites could come back):\n%s", err, out)
	}
}

// blobRewriteChild stores 8 blocks in one Put (one blob file), flips a byte
// of block 7's bytes there, holds 7 and 8, and evicts the rest with more
// Puts, each one flushed and followed by Pebble's look for compactions.
func blobRewriteChild(t *testing.T, rewrites bool) {
	testHookValueSeparation = func(p *pebble.ValueSeparationPolicy) {
		p.RewriteMinimumAge = 0
		if rewrites {
			p.TargetGarbageRatio = 0.3
		}
	}
	t.Cleanup(func() { testHookValueSeparation = nil })
	const bs = 4096 // in a blob file (value separation starts at 1 KiB)
	blob := func(h uint64) []byte {
		b, r := make([]byte, bs), rand.NewChaCha8([32]byte{byte(h)})
		r.Read(b)
		return b
	}
	dir := t.TempDir()
	var log testlog.Buffer
	p, err := OpenDisk(dir, Config{Capacity: 10, BlockSize: bs, Logger: slog.New(slog.NewTextHandler(&log, nil))},
		DiskOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	var blocks []Block
	var data [][]byte
	for h := uint64(1); h <= 8; h++ {
		blocks = append(blocks, Block{Hash: h, Local: h})
		data = append(data, blob(h))
	}
	if n, err := p.Put(blocks, data); n != 8 || err != nil {
		t.Fatalf("Put: %d, %v", n, err)
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	want, found := blob(7)[100:164], false
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".blob") {
			continue
		}
		name := filepath.Join(dir, e.Name())
		b, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if i := bytes.Index(b, want); i >= 0 {
			f, err := os.OpenFile(name, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			_, err = f.WriteAt([]byte{b[i+10] ^ 0xff}, int64(i+10))
			if err := errors.Join(err, f.Close()); err != nil {
				t.Fatal(err)
			}
			found = true
		}
	}
	if !found {
		t.Fatal("block 7's bytes are in no blob file")
	}
	// Blocks 7 and 8 stay live (held, as an onboarding holds them); the
	// other six of their blob file are evicted: 75% garbage.
	for _, h := range []uint64{7, 8} {
		if err := p.Acquire(h); err != nil {
			t.Fatal(err)
		}
	}
	for h := uint64(9); h < 209; h++ {
		if err := p.Register(Block{Hash: h, Local: h}, blob(h)); err != nil {
			t.Fatalf("Register(%d): %v", h, err)
		}
	}
	buf := make([]byte, bs)
	if err := p.ReadHeld(7, buf); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("ReadHeld of the damaged block: %v, want ErrCorrupt", err)
	}
	if err := p.ReadHeld(8, buf); err != nil || !bytes.Equal(buf, blob(8)) {
		t.Fatalf("ReadHeld of the intact block of the same blob file: %v", err)
	}
	for _, h := range []uint64{7, 8} {
		if err := p.Release(h); err != nil {
			t.Fatal(err)
		}
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
}

// orderSink records the events published to it, in order.
type orderSink struct {
	mu  sync.Mutex
	evs []kvevent.Event
}

func (s *orderSink) Publish(_ kvevent.Rank, evs []kvevent.Event) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.evs = append(s.evs, evs...)
	return uint64(len(s.evs)), nil
}

func (s *orderSink) events() []kvevent.Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.evs)
}

// kvagent republishes a reopened pool's blocks (Dump, then its agent's
// Restore). A shutdown for damage right after the open (a background job
// meeting damage the open did not read) could publish its REMOVEs between
// the two: the restore then advertised blocks the pool no longer held,
// for good. DumpTo runs the restore under the pool's lock, so the
// shutdown's REMOVEs come after it.
func TestDiskDumpToKeepsAShutdownsRemovesAfterTheRestore(t *testing.T) {
	s := &orderSink{}
	p, err := OpenDisk(t.TempDir(), Config{Capacity: 8, BlockSize: internalBlock, Sink: s}, DiskOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	for h := uint64(1); h <= 3; h++ {
		if err := p.Register(Block{Hash: h, Local: h}, blockBytes(h)); err != nil {
			t.Fatal(err)
		}
	}
	published := len(s.events())
	err = p.DumpTo(func(evs []kvevent.Event) error {
		// Damage met now, as by a compaction: the shutdown starts (it
		// holds the pool's I/O lock) while the blocks are being restored.
		p.damage.background(fmt.Errorf("%w: injected", pebble.ErrCorruption))
		deadline := time.Now().Add(time.Minute)
		for p.io.TryRLock() {
			p.io.RUnlock()
			if len(s.events()) > published {
				break // the shutdown is done already: its REMOVEs came first
			}
			if time.Now().After(deadline) {
				t.Error("the shutdown did not start in a minute")
				break
			}
			time.Sleep(time.Millisecond)
		}
		_, err := s.Publish(Config{}.Rank, evs) // the restore
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(time.Minute)
	for p.Stats().Used != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the pool did not shut down in a minute")
		}
		time.Sleep(time.Millisecond)
	}
	advertised := map[uint64]bool{}
	for _, ev := range s.events()[published:] {
		for _, b := range ev.Blocks {
			advertised[b.EngineHash] = true
		}
		for _, h := range ev.Removed {
			delete(advertised, h)
		}
	}
	if len(advertised) != 0 {
		t.Fatalf("after the restore and the shutdown, blocks %v are still advertised: %+v",
			slices.Sorted(maps.Keys(advertised)), s.events()[published:])
	}
}

// The damage watch shuts the pool down at the third failed compaction in a
// row with the same error, and not at failures of differing errors: two
// errors in turn (a passing fault beside another) are not a file that
// cannot be read, and each restarts the count.
//
// From a review: nothing failed when the count was no longer restarted, so
// that any three failures shut the pool down.
func TestDiskDamageWatchShutsDownOnlyAtTheSameCompactionErrorThreeTimesInARow(t *testing.T) {
	var log testlog.Buffer
	w := newDamageWatch(slog.New(slog.NewTextHandler(&log, nil)))
	a := &os.PathError{Op: "read", Path: "000007.sst", Err: syscall.EIO}
	b := &os.PathError{Op: "read", Path: "000008.sst", Err: syscall.EIO}
	fail := func(err error) error {
		w.compaction(pebble.CompactionInfo{Err: err})
		_, why := w.state()
		return why
	}

	for i := range 10 {
		err := error(a)
		if i%2 == 1 {
			err = b
		}
		if why := fail(err); why != nil {
			t.Fatalf("failure %d (errors A and B in turn) shut the pool down: %v", i+1, why)
		}
	}
	for i := range compactionFailures {
		why := fail(a)
		if i < compactionFailures-1 && why != nil {
			t.Fatalf("A failure %d of %d in a row shut the pool down: %v", i+1, compactionFailures, why)
		}
		if i == compactionFailures-1 && !errors.Is(why, syscall.EIO) {
			t.Fatalf("after A failed %d times in a row, the shutdown's cause is %v, want A", compactionFailures, why)
		}
	}
	if n := len(log.Lines("the disk pool shuts down")); n != 1 {
		t.Fatalf("the shutdown was logged %d times, want once:\n%s", n, log.String())
	}
}

// Only reads that fail in a row count toward dropping a block (see
// unreadable): a successful read between restarts the count, so a block
// the disk failed to read now and then is kept. (A test through a failing
// file system cannot fail a block's read again after one success: Pebble's
// block cache then holds its bytes.)
func TestDiskSuccessfulReadRestartsTheBlocksFailureCount(t *testing.T) {
	p := openInternal(t, t.TempDir(), nil)
	if err := p.Register(Block{Hash: 1, Local: 1}, bytes.Repeat([]byte{1}, internalBlock)); err != nil {
		t.Fatal(err)
	}
	p.c.mu.Lock()
	e := p.c.entries[1]
	p.c.mu.Unlock()
	eio := &os.PathError{Op: "read", Path: "000006.blob", Err: syscall.EIO}
	buf := make([]byte, internalBlock)
	for round := range 3 {
		for i := range readFailures - 1 {
			if unreadable(e, eio) {
				t.Fatalf("round %d: failure %d of %d in a row says the block is unreadable", round, i+1, readFailures-1)
			}
		}
		if err := p.Read(1, buf); err != nil {
			t.Fatal(err)
		}
		if n := e.readFails.Load(); n != 0 {
			t.Fatalf("round %d: after a successful read, %d failures still counted", round, n)
		}
	}
	for range readFailures - 1 {
		unreadable(e, eio)
	}
	if !unreadable(e, eio) {
		t.Fatalf("the %d-th failure in a row does not say the block is unreadable", readFailures)
	}
}
