// Package store keeps everything kvrouter writes to disk through Pebble. Each
// durable concern has its own Pebble database. LogStore is the Raft log store
// and stable store: the node's raft/ directory, implementing raft.LogStore,
// raft.StableStore and raft.MonotonicLogStore for github.com/hashicorp/raft.
//
// Invariants of LogStore:
//   - Every write is one Pebble batch committed with pebble.Sync: when
//     StoreLogs, DeleteRange, Set or SetUint64 returns nil, the change survives
//     a crash, and a crash leaves either all of a call's change or none of it.
//   - Log entries live under keyspace prefix 'l' followed by the big-endian
//     uint64 index, so key order is index order; stable-store keys live under
//     prefix 's'. Every iterator is bounded to one prefix.
//   - FirstIndex and LastIndex are the smallest and largest stored index (0 and
//     0 for an empty log), served from atomics that are loaded at open, raised
//     by StoreLogs after its commit and recomputed from disk after DeleteRange.
//   - GetLog of a missing index returns raft.ErrLogNotFound itself, unwrapped;
//     Get of a missing key returns ErrKeyNotFound, whose text is exactly
//     "not found"; GetUint64 of a missing key returns 0, nil. hashicorp/raft
//     compares these by identity and by text, so they must never be wrapped.
//   - No byte slice handed out aliases Pebble's memory: values are copied
//     before the getter or iterator that produced them is closed.
//   - After Close every method returns an error wrapping ErrClosed; none panics.
//
// See DESIGN.md for the key layout, the entry encoding and the durability
// argument.
package store
