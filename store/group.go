package store

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"fmt"
	"slices"
	"strings"

	"github.com/cockroachdb/pebble/v2/objstorage/objstorageprovider"
	"github.com/cockroachdb/pebble/v2/sstable"
	"github.com/cockroachdb/pebble/v2/vfs"
)

// StateBatch collects the writes of a group of applies. Commit writes them
// atomically and durably as one sorted sstable ingested into the database.
//
// Why not a Pebble batch: the FSM writes about 1.4 records per block
// event under random engine hashes. Through a batch, each record is
// encoded, inserted into the memtable's skiplist (a cache miss per level),
// or — for a batch of half a memtable or more — sorted by comparing
// varint-prefixed keys decoded from the batch, and then read back and
// written again by the flush. Here a record is appended to an arena once;
// Commit sorts 32-byte handles on the first 16 key bytes held as integers
// (random hashes settle almost every comparison there), keeps the last
// write of each key, and streams the result into an sstable writer: every
// byte is copied once, and the memtable and the flush are skipped.
//
// Ordering: the records of one group share one sequence number in the
// database (an ingested table's), so a key must appear once in a table:
// the last write of a key in the group wins, as it would in a batch. A
// delete is written as a point tombstone, which also hides what earlier
// groups wrote under the key.
type StateBatch struct {
	s     *StateDB
	arena []byte    // keys and values, back to back
	ops   []groupOp // one per write, in write order
	key   []byte    // scratch for building keys
	val   []byte    // scratch for building values
}

// groupOp is one write: its key's first 16 bytes as big-endian integers
// (zero padded, so integer order is byte order), where key and value sit
// in the arena, and its place in write order.
type groupOp struct {
	k0, k1 uint64
	off    uint32 // key at arena[off:off+klen], value right after
	klen   uint16
	del    bool
	vlen   uint32
	nth    uint32 // write order, to keep the last write of a key
}

// GroupBytes is the default size at which the FSM commits the group it
// keeps across applies. Larger groups mean fewer, larger tables (fewer L0
// sublevels to compact) for more memory and a longer pause at commit.
const GroupBytes = 16 << 20

// NewBatch starts an empty group.
func (s *StateDB) NewBatch() *StateBatch {
	// The key and value scratch buffers hold the largest record of the
	// fixed layouts (a residency key, 21 bytes), so appends never grow them.
	return &StateBatch{s: s, key: make([]byte, 0, 64), val: make([]byte, 0, 64)}
}

func (b *StateBatch) add(key, value []byte, del bool) {
	var pad [16]byte
	copy(pad[:], key)
	off := len(b.arena)
	b.arena = append(b.arena, key...)
	b.arena = append(b.arena, value...)
	b.ops = append(b.ops, groupOp{
		k0: binary.BigEndian.Uint64(pad[:8]), k1: binary.BigEndian.Uint64(pad[8:]),
		off: uint32(off), klen: uint16(len(key)), vlen: uint32(len(value)), del: del, nth: uint32(len(b.ops)),
	})
}

func (b *StateBatch) set(key, value []byte) { b.add(key, value, false) }
func (b *StateBatch) del(key []byte)        { b.add(key, nil, true) }

// Empty reports whether the group holds no writes.
func (b *StateBatch) Empty() bool { return len(b.ops) == 0 }

// Len is the group's size in bytes (keys and values).
func (b *StateBatch) Len() int { return len(b.arena) }

// Close releases the group's memory.
func (b *StateBatch) Close() error {
	b.arena, b.ops = nil, nil
	return nil
}

func (b *StateBatch) keyOf(o *groupOp) []byte {
	return b.arena[o.off : o.off+uint32(o.klen)]
}

// Commit writes the group as one table and ingests it: atomically (a
// table is ingested whole or not at all) and durably (the ingest syncs
// the table and the manifest). The group is empty afterwards.
func (b *StateBatch) Commit() error {
	if len(b.ops) == 0 {
		return nil
	}
	slices.SortFunc(b.ops, func(x, y groupOp) int {
		if c := cmp.Compare(x.k0, y.k0); c != 0 {
			return c
		}
		if c := cmp.Compare(x.k1, y.k1); c != 0 {
			return c
		}
		if x.klen > 16 || y.klen > 16 {
			if c := bytes.Compare(b.keyOf(&x), b.keyOf(&y)); c != 0 {
				return c
			}
		} else if c := cmp.Compare(x.klen, y.klen); c != 0 {
			return c
		}
		return cmp.Compare(x.nth, y.nth)
	})
	s := b.s
	path := s.fs.PathJoin(s.dir, fmt.Sprintf("group-%06d.sst", s.groups.Add(1)))
	f, err := s.fs.Create(path, vfs.WriteCategoryUnspecified)
	if err != nil {
		return fmt.Errorf("commit state group: %w", err)
	}
	w := sstable.NewWriter(objstorageprovider.NewFileWritable(f), sstable.WriterOptions{TableFormat: s.db.TableFormat()})
	for i := range b.ops {
		o := &b.ops[i]
		k := b.keyOf(o)
		if i+1 < len(b.ops) && bytes.Equal(k, b.keyOf(&b.ops[i+1])) {
			continue // a later write of the same key wins
		}
		if o.del {
			err = w.Delete(k)
		} else {
			end := o.off + uint32(o.klen)
			err = w.Set(k, b.arena[end:end+o.vlen])
		}
		if err != nil {
			break
		}
	}
	if cerr := w.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = s.db.Ingest(context.Background(), []string{path})
	}
	// An ingested table is linked into the database; the name written here
	// goes either way.
	_ = s.fs.Remove(path)
	if err != nil {
		return fmt.Errorf("commit state group: %w", err)
	}
	b.arena, b.ops = b.arena[:0], b.ops[:0]
	return nil
}

// removeStaleGroups removes group tables that a crash left unlinked
// between their writing and their ingest (an ingested table lives on under
// Pebble's own name; these names are never Pebble's).
func removeStaleGroups(fs vfs.FS, dir string) {
	names, err := fs.List(dir)
	if err != nil {
		return
	}
	for _, n := range names {
		if strings.HasPrefix(n, "group-") && strings.HasSuffix(n, ".sst") {
			_ = fs.Remove(fs.PathJoin(dir, n))
		}
	}
}
