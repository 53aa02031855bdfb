package store

import (
	"encoding/binary"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"github.com/cockroachdb/pebble/v2"
)

// BenchmarkGroupCommit: one group of 200k residency and 100k tree-node
// writes under random hashes (the FSM's bulk), written and made durable,
// per op. ours: StateBatch (radix sort, one table, ingest). pebble_batch,
// the baseline: the same writes in one Pebble batch (large enough to skip
// the memtable: Pebble sorts it itself), committed, then flushed so that
// the writes are durable too.
//
//	go test -run XXX -bench GroupCommit -benchtime 10x ./store
func BenchmarkGroupCommit(b *testing.B) {
	const entries, nodes = 200_000, 100_000
	rng := rand.New(rand.NewPCG(20261201, 1))
	type w struct {
		worker, eh, seq uint64
		dp              uint32
	}
	ws := make([]w, entries)
	for i := range ws {
		ws[i] = w{worker: uint64(rng.IntN(16) + 1), dp: uint32(rng.IntN(4)), eh: rng.Uint64(), seq: rng.Uint64()}
	}
	open := func(b *testing.B) *StateDB {
		s, err := OpenState(filepath.Join(b.TempDir(), "fsm"), StateOptions{Logger: logStoreTestLogger(b)})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { s.Close() })
		return s
	}
	b.Run("ours", func(b *testing.B) {
		s := open(b)
		g := s.NewBatch()
		for b.Loop() {
			for i := range ws {
				g.PutEntry(ws[i].worker, ws[i].dp, ws[i].eh, ws[i].seq, 1, uint32(i))
				if i < nodes {
					g.PutNode(ws[i].seq, ws[i].eh, false, ws[i].eh)
				}
			}
			g.SetApplied(1, 1)
			if err := g.Commit(); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("pebble_batch", func(b *testing.B) {
		s := open(b)
		var k, v []byte
		for b.Loop() {
			pb := s.db.NewBatch()
			for i := range ws {
				k = append(k[:0], KindEntry)
				k = binary.BigEndian.AppendUint64(k, ws[i].worker)
				k = binary.BigEndian.AppendUint32(k, ws[i].dp)
				k = binary.BigEndian.AppendUint64(k, ws[i].eh)
				v = binary.BigEndian.AppendUint64(v[:0], ws[i].seq)
				v = append(v, 1)
				v = binary.BigEndian.AppendUint32(v, uint32(i))
				_ = pb.Set(k, v, nil)
				if i < nodes {
					k = append(k[:0], KindNode)
					k = binary.BigEndian.AppendUint64(k, ws[i].seq)
					v = binary.BigEndian.AppendUint64(v[:0], ws[i].eh)
					v = binary.BigEndian.AppendUint64(v, ws[i].eh)
					_ = pb.Set(k, append(v, 0), nil)
				}
			}
			_ = pb.Set(appliedKey, make([]byte, 16), nil)
			if err := pb.Commit(pebble.NoSync); err != nil {
				b.Fatal(err)
			}
			pb.Close()
			if err := s.db.Flush(); err != nil {
				b.Fatal(err)
			}
		}
	})
}
