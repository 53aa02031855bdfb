package pool

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/cockroachdb/pebble/v2"

	"github.com/kvrouter/kvrouter/internal/testlog"
	"github.com/kvrouter/kvrouter/internal/testseed"
)

// rewrite sets raw key/value pairs (alternating) in a closed pool's
// database, as damage or a foreign writer would leave them.
func rewrite(t *testing.T, dir string, kvs ...[]byte) {
	t.Helper()
	p := openInternal(t, dir, nil)
	b := p.db.NewBatch()
	for i := 0; i+1 < len(kvs); i += 2 {
		if err := b.Set(kvs[i], kvs[i+1], nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Commit(pebble.NoSync); err != nil {
		t.Fatal(err)
	}
	b.Close()
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
}

// A block whose stored bytes are not BlockSize long can never be read: a
// reopen deletes it, as it deletes other blocks it cannot use, instead of
// restoring and advertising it until its first read fails. Short bytes
// stay inline in the key tables, long ones go to a blob file: both are
// caught. The valid blocks, a child of the dropped block included, stay.
func TestDiskReopenDeletesBlocksOfTheWrongSize(t *testing.T) {
	dir := t.TempDir()
	p := openInternal(t, dir, nil)
	if n, err := p.Put([]Block{{Hash: 1, Local: 11}, {Hash: 2, Parent: 1, Local: 22}, {Hash: 3, Parent: 2, Local: 33}, {Hash: 4, Local: 44}},
		[][]byte{blockBytes(1), blockBytes(2), blockBytes(3), blockBytes(4)}); n != 4 || err != nil {
		t.Fatalf("put: %d, %v", n, err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	rewrite(t, dir,
		hashKey(kindData, 2), blockBytes(2)[:internalBlock/2], // short: inline
		hashKey(kindData, 4), bytes.Repeat([]byte{4}, 4096)) // long: a blob

	log := &testlog.Buffer{}
	p = openInternal(t, dir, log)
	if got := p.Lookup([]uint64{1, 2, 3, 4}, nil); !slices.Equal(got, []bool{true, false, true, false}) {
		t.Fatalf("reopened pool holds %v of blocks 1-4, want 1 and 3 (2 and 4 have the wrong size)", got)
	}
	if st := p.Stats(); st.Used != 2 {
		t.Fatalf("reopened pool: %+v, want 2 blocks", st)
	}
	evs, _ := p.Dump()
	var dumped []uint64
	for _, e := range evs {
		for _, b := range e.Blocks {
			dumped = append(dumped, b.EngineHash)
		}
	}
	if slices.Sort(dumped); !slices.Equal(dumped, []uint64{1, 3}) {
		t.Fatalf("dumped %v, want [1 3]", dumped)
	}
	buf := make([]byte, internalBlock)
	for _, h := range []uint64{1, 3} {
		if err := p.Read(h, buf); err != nil || !bytes.Equal(buf, blockBytes(h)) {
			t.Fatalf("read %d: %v", h, err)
		}
	}
	if !strings.Contains(log.String(), "invalid=2") {
		t.Fatalf("the reopen logged %q, without invalid=2", log.String())
	}
	want := [][]byte{hashKey(kindData, 1), hashKey(kindData, 3), {kindHeader}, {kindIdent}, hashKey(kindMeta, 1), hashKey(kindMeta, 3)}
	if got := keys(t, p); !slices.EqualFunc(got, want, bytes.Equal) {
		t.Fatalf("keys after reopening: %x, want %x", got, want)
	}
}

// Blocks of production size live in blob files, where the scan at open
// sees only a reference: its recorded length must pass a block of the
// right size, and fail one a byte short, without reading either.
func TestDiskReopenChecksTheSizeOfBlobBytes(t *testing.T) {
	const bs = 4096 // above the value separation's MinimumSize
	dir := t.TempDir()
	cfg := Config{Capacity: 8, BlockSize: bs}
	block := func(h uint64, n int) []byte { return bytes.Repeat([]byte{byte(h)}, n) }
	p, err := OpenDisk(dir, cfg, DiskOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if n, err := p.Put([]Block{{Hash: 1}, {Hash: 2}}, [][]byte{block(1, bs), block(2, bs)}); n != 2 || err != nil {
		t.Fatalf("put: %d, %v", n, err)
	}
	b := p.db.NewBatch()
	b.Set(hashKey(kindData, 2), block(2, bs-1), nil)
	if err := p.commitBatch(b); err != nil {
		t.Fatal(err)
	}
	b.Close()
	if m := p.db.Metrics(); m.BlobFiles.LiveCount == 0 {
		t.Fatalf("no blob file after a flush of %d-byte values: the test checks nothing", bs)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}

	p, err = OpenDisk(dir, cfg, DiskOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if got := p.Lookup([]uint64{1, 2}, nil); !slices.Equal(got, []bool{true, false}) {
		t.Fatalf("reopened pool holds %v of blocks 1 and 2, want only 1 (2 is a byte short)", got)
	}
	buf := make([]byte, bs)
	if err := p.Read(1, buf); err != nil || !bytes.Equal(buf, block(1, bs)) {
		t.Fatalf("read 1: %v", err)
	}
}

// Put refuses a block that would be its own ancestor, but a pool's
// database can hold a loop of parents all the same (damage, a foreign
// writer). Restored, the blocks of a loop would never be evicted (each
// has a child in the pool) nor dumped (none is a root): a reopen deletes
// them. A block hanging off a loop is valid, and stays as one whose parent
// is not in the pool, as the children of other deleted blocks do.
func TestDiskReopenDeletesParentCycles(t *testing.T) {
	dir := t.TempDir()
	p := openInternal(t, dir, nil)
	if n, err := p.Put([]Block{{Hash: 1, Local: 11}, {Hash: 2, Parent: 1, Local: 22}}, [][]byte{blockBytes(1), blockBytes(2)}); n != 2 || err != nil {
		t.Fatalf("put: %d, %v", n, err)
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	var kvs [][]byte
	for _, b := range []Block{
		{Hash: 5, Parent: 6}, {Hash: 6, Parent: 5}, // a loop of two
		{Hash: 10, Parent: 12}, {Hash: 11, Parent: 10}, {Hash: 12, Parent: 11}, // of three
		{Hash: 7, Parent: 5}, // a child of the first loop
	} {
		b.Local = b.Hash * 11
		kvs = append(kvs, hashKey(kindMeta, b.Hash), encodeMeta(b, 100+b.Hash), hashKey(kindData, b.Hash), blockBytes(b.Hash))
	}
	rewrite(t, dir, kvs...)

	log := &testlog.Buffer{}
	p = openInternal(t, dir, log)
	all := []uint64{1, 2, 5, 6, 7, 10, 11, 12}
	if got, want := p.Lookup(all, nil), []bool{true, true, false, false, true, false, false, false}; !slices.Equal(got, want) {
		t.Fatalf("reopened pool holds %v of %v, want %v", got, all, want)
	}
	if !strings.Contains(log.String(), "invalid=5") {
		t.Fatalf("the reopen logged %q, without invalid=5", log.String())
	}
	st := p.Stats()
	evs, _ := p.Dump()
	dumped := 0
	for _, e := range evs {
		dumped += len(e.Blocks)
	}
	if st.Used != 3 || dumped != 3 {
		t.Fatalf("reopened pool holds %d blocks and dumps %d, want 3 each (stats %+v)", st.Used, dumped, st)
	}
	// Every block is evictable in turn: a full pool takes new blocks.
	for h := uint64(100); h < 108; h++ {
		if err := p.Register(Block{Hash: h}, blockBytes(h)); err != nil {
			t.Fatalf("register %d: %v (stats %+v)", h, err, p.Stats())
		}
	}
	for _, k := range keys(t, p) {
		if h, ok := keyHash(k); ok && h < 100 {
			t.Fatalf("key %x of an old block left after it was evicted or deleted", k)
		}
	}
}

// splitLoops against the definition: a block is on a loop when walking up
// from its parent comes back to it (within as many steps as there are
// blocks). Random parents among few hashes make loops of every length,
// chains into them and chains out of the pool.
func TestSplitLoopsMatchesNaiveWalk(t *testing.T) {
	rng := rand.New(rand.NewPCG(testseed.Seed(t), 0))
	for round := 0; round < 500; round++ {
		n := 1 + rng.IntN(20)
		var bs []restored
		for _, h := range rng.Perm(n) {
			parent := uint64(rng.IntN(n + 3)) // some outside the pool, some 0
			if parent == uint64(h+1) {
				parent = 0 // its own parent: dropped before splitLoops
			}
			bs = append(bs, restored{Block: Block{Hash: uint64(h + 1), Parent: parent}})
		}
		parent := make(map[uint64]uint64)
		for _, b := range bs {
			parent[b.Hash] = b.Parent
		}
		var wantKept, wantLooped []uint64
		for _, b := range bs {
			h, loop := b.Parent, false
			for range len(bs) {
				if h == b.Hash {
					loop = true
					break
				}
				if h = parent[h]; h == 0 {
					break
				}
			}
			if loop {
				wantLooped = append(wantLooped, b.Hash)
			} else {
				wantKept = append(wantKept, b.Hash)
			}
		}
		kept, looped := splitLoops(slices.Clone(bs))
		var gotKept []uint64
		for _, b := range kept {
			gotKept = append(gotKept, b.Hash)
		}
		if !slices.Equal(gotKept, wantKept) || !slices.Equal(looped, wantLooped) {
			t.Fatalf("round %d, blocks %+v: kept %v, looped %v; want %v, %v", round, bs, gotKept, looped, wantKept, wantLooped)
		}
	}
}
