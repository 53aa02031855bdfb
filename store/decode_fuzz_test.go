package store

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"
)

// encoded returns the key (without its kind byte) and the value of the
// last write of b.
func encoded(t testing.TB, b *StateBatch) (key, value []byte) {
	t.Helper()
	if len(b.ops) == 0 {
		t.Fatal("no write in the batch")
	}
	o := b.ops[len(b.ops)-1]
	k := b.keyOf(&o)
	n := binary.LittleEndian.Uint32(b.arena[o.off:])
	start := o.off + 4 + uint32(o.klen)
	return k[1:], b.arena[start : start+n]
}

// FuzzDecodeRecords feeds arbitrary keys and values to the decoders of
// the state database's fixed-layout records. None panics, each refuses
// with ErrCorrupt what it does not take, and what one takes is canonical:
// the matching StateBatch writer encodes the decoded fields back to the
// same bytes, so a record has one encoding and a bit flip in it is either
// refused or a different record. One exception, written by no build but
// accepted as the same record: a 16-byte cursor whose incarnation is 0
// (PutCursor leaves a zero incarnation out, 8 bytes).
func FuzzDecodeRecords(f *testing.F) {
	b := (&StateDB{}).NewBatch()
	seed := func(write func()) {
		write()
		k, v := encoded(f, b)
		f.Add(bytes.Clone(k), bytes.Clone(v))
	}
	seed(func() { b.PutNode(7, 3, true, 9) })
	seed(func() { b.PutEntry(1, 2, 3, 4, 5, 6) })
	seed(func() { b.PutCursor(1, 2, 3, 4) })
	seed(func() { b.PutCursor(1, 2, 3, 0) })
	seed(func() { b.SetApplied(5, 6) })
	f.Add(make([]byte, 8), append(make([]byte, 16), 2)) // a node whose root flag is neither 0 nor 1
	f.Fuzz(func(t *testing.T, k, v []byte) {
		b := (&StateDB{}).NewBatch()
		refused := func(what string, err error) bool {
			t.Helper()
			if err != nil && !errors.Is(err, ErrCorrupt) {
				t.Fatalf("%s: %v, not ErrCorrupt", what, err)
			}
			return err != nil
		}
		same := func(what string, gotK, wantK, gotV, wantV []byte) {
			t.Helper()
			if wantK != nil && !bytes.Equal(gotK, wantK) {
				t.Fatalf("%s: key %x decodes and encodes back as %x", what, wantK, gotK)
			}
			if wantV != nil && !bytes.Equal(gotV, wantV) {
				t.Fatalf("%s: value %x decodes and encodes back as %x", what, wantV, gotV)
			}
		}

		if idx, term, err := DecodeApplied(v); !refused("DecodeApplied", err) {
			b.SetApplied(idx, term)
			_, gv := encoded(t, b)
			same("applied", nil, nil, gv, v)
		}
		if parent, local, root, err := DecodeNode(v); !refused("DecodeNode", err) {
			b.PutNode(0, parent, root, local)
			_, gv := encoded(t, b)
			same("node", nil, nil, gv, v)
		}
		if seq, err := DecodeU64(k); !refused("DecodeU64", err) {
			b.PutNode(seq, 0, false, 0)
			gk, _ := encoded(t, b)
			same("node key", gk, k, nil, nil)
		}
		if w, dp, eh, seq, mask, order, err := DecodeEntry(k, v); !refused("DecodeEntry", err) {
			b.PutEntry(w, dp, eh, seq, mask, order)
			gk, gv := encoded(t, b)
			same("residency", gk, k, gv, v)
		}
		if w, dp, err := DecodeRankKey(k); !refused("DecodeRankKey", err) {
			b.PutRank(w, dp, nil)
			gk, _ := encoded(t, b)
			same("rank key", gk, k, nil, nil)
			b.PutCursor(w, dp, 0, 0)
			gk, _ = encoded(t, b)
			same("cursor key", gk, k, nil, nil)
		}
		if id, inc, err := DecodeCursor(v); !refused("DecodeCursor", err) {
			b.PutCursor(0, 0, id, inc)
			_, gv := encoded(t, b)
			want := v
			if len(v) == 16 && inc == 0 {
				want = v[:8] // the one accepted non-canonical form (above)
			}
			same("cursor", nil, nil, gv, want)
		}
	})
}
