package store

import "encoding/binary"

// Key layout of the raft/ database. Every key starts with one prefix byte
// that names its keyspace; keyspaces never interleave, so a bounded iterator
// over one prefix never sees another's keys.
//
//	'l' | uint64 big-endian index   -> encoded raft.Log (codec.go)
//	's' | stable-store key bytes    -> value bytes (SetUint64: 8 bytes big-endian)
//	'm' | "format"                  -> one byte: the layout version
//
// Big-endian makes byte order equal numeric order, so FirstIndex and LastIndex
// are the first and last keys of the 'l' keyspace and DeleteRange(min, max) is
// the single key span ['l'|min, 'l'|max+1).
const (
	prefixLog    byte = 'l'
	prefixStable byte = 's'
	prefixMeta   byte = 'm'

	logKeyLen = 1 + 8
)

// layoutVersion is stored under metaFormatKey when a database is created and
// checked on every open.
const layoutVersion byte = 1

var metaFormatKey = []byte{prefixMeta, 'f', 'o', 'r', 'm', 'a', 't'}

// logKey returns the key of the log entry at index.
func logKey(index uint64) []byte {
	k := make([]byte, logKeyLen)
	k[0] = prefixLog
	binary.BigEndian.PutUint64(k[1:], index)
	return k
}

// logKeyIndex returns the index a log key names and whether k is a
// well-formed log key.
func logKeyIndex(k []byte) (uint64, bool) {
	if len(k) != logKeyLen || k[0] != prefixLog {
		return 0, false
	}
	return binary.BigEndian.Uint64(k[1:]), true
}

// logKeyUpperBound is the exclusive upper bound of the whole log keyspace.
func logKeyUpperBound() []byte { return []byte{prefixLog + 1} }

// logSpanEnd returns the exclusive end key of a span whose last included
// index is max. For max == MaxUint64 there is no max+1 key, so the end is the
// end of the log keyspace.
func logSpanEnd(max uint64) []byte {
	if max == ^uint64(0) {
		return logKeyUpperBound()
	}
	return logKey(max + 1)
}

// stableKey returns the database key of a stable-store key.
func stableKey(key []byte) []byte {
	k := make([]byte, 1+len(key))
	k[0] = prefixStable
	copy(k[1:], key)
	return k
}
