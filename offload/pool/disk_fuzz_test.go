package pool

import (
	"encoding/binary"
	"log/slog"
	"slices"
	"testing"

	"github.com/cockroachdb/pebble/v2"
	"github.com/cockroachdb/pebble/v2/vfs"
)

// FuzzDiskLoad writes arbitrary records into a pool's key space (metadata
// well formed or not, bytes of any length, keys of odd lengths: what
// damage or a foreign writer could leave) and reopens the pool. Whatever
// it finds, the open does not panic and restores only blocks the pool can
// use: each is dumped (no loop of parents hides it), reads back, and is
// restored again by the next open; a full pool still takes new blocks
// (everything restored can be evicted).
//
// The input is read in records: 0 h x s metadata of block h%8 with parent
// x%8 and stamp s; 1 h x bytes of length x%128 (the block size is 64);
// 2 h n ... n%32 raw bytes as h's metadata; 3 h x a 3-byte key in the
// metadata range.
func FuzzDiskLoad(f *testing.F) {
	f.Add([]byte{0, 1, 0, 1, 1, 1, 64})                                             // one valid block
	f.Add([]byte{0, 1, 0, 1, 1, 1, 64, 0, 2, 1, 2, 1, 2, 64})                       // a chain 1 ← 2
	f.Add([]byte{0, 1, 2, 1, 1, 1, 64, 0, 2, 1, 2, 1, 2, 64, 0, 3, 1, 3, 1, 3, 64}) // a loop 1 ⇄ 2, and 3 off it
	f.Add([]byte{0, 1, 0, 1, 1, 1, 63})                                             // bytes a byte short
	f.Add([]byte{2, 1, 4, 1, 2, 3, 4, 1, 1, 64, 3, 1, 1})                           // short metadata, an odd key
	f.Fuzz(runDiskLoad)
}

func runDiskLoad(t *testing.T, in []byte) {
	fs := vfs.NewMem()
	cfg := Config{Capacity: 4, BlockSize: internalBlock, Logger: slog.New(slog.DiscardHandler)}
	open := func() *DiskPool {
		t.Helper()
		p, err := OpenDisk("/p", cfg, DiskOptions{FS: fs})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	p := open()
	b := p.db.NewBatch()
	for len(in) >= 3 {
		kind, h, x := in[0], uint64(in[1]%8), in[2]
		in = in[3:]
		switch kind % 4 {
		case 0:
			stamp := uint64(0)
			if len(in) > 0 {
				stamp, in = uint64(in[0]), in[1:]
			}
			v := make([]byte, metaLen)
			v[0] = diskFormat
			binary.BigEndian.PutUint64(v[1:], uint64(x%8))
			binary.BigEndian.PutUint64(v[9:], uint64(x))
			binary.BigEndian.PutUint64(v[17:], stamp)
			b.Set(hashKey(kindMeta, h), v, nil)
		case 1:
			b.Set(hashKey(kindData, h), make([]byte, int(x)%(2*internalBlock)), nil)
		case 2:
			n := min(int(x)%32, len(in))
			b.Set(hashKey(kindMeta, h), slices.Clone(in[:n]), nil)
			in = in[n:]
		case 3:
			b.Set([]byte{kindMeta, byte(h), x}, nil, nil)
		}
	}
	if err := b.Commit(pebble.NoSync); err != nil {
		t.Fatal(err)
	}
	b.Close()
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}

	p = open()
	defer p.Close()
	st := p.Stats()
	held := dumped(t, p)
	if len(held) != st.Used {
		t.Fatalf("the reopened pool holds %d blocks and dumps %d: %v (stats %+v)", st.Used, len(held), held, st)
	}
	for _, h := range held {
		if err := p.Read(h, make([]byte, internalBlock)); err != nil {
			t.Fatalf("restored block %#x does not read: %v", h, err)
		}
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	p = open()
	defer p.Close()
	if again := dumped(t, p); !slices.Equal(again, held) {
		t.Fatalf("a second reopen restores %v, the first %v", again, held)
	}
	for h := uint64(100); h < 100+uint64(cfg.Capacity); h++ {
		if _, err := p.Put([]Block{{Hash: h, Local: h}}, [][]byte{make([]byte, internalBlock)}); err != nil {
			t.Fatalf("put %d into the reopened pool (stats before %+v): %v", h, st, err)
		}
	}
}

// dumped returns the hashes of the blocks p dumps, sorted, and fails on an
// invalid event.
func dumped(t *testing.T, p *DiskPool) []uint64 {
	t.Helper()
	evs, _ := p.Dump()
	var hs []uint64
	for _, e := range evs {
		if err := e.Validate(); err != nil {
			t.Fatalf("dumped %+v: %v", e, err)
		}
		for _, b := range e.Blocks {
			hs = append(hs, b.EngineHash)
		}
	}
	slices.Sort(hs)
	return hs
}
