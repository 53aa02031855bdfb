// Package pool holds the node agent's offloaded KV blocks, one pool per
// tier: HostPool in one large region of pinned host memory (G2, from an
// offload/backend.Backend) split into fixed-size slots, and DiskPool in a
// Pebble database on local disk (G3) that survives a restart.
//
// Both share one core (core.go) for the bookkeeping: which sequence hashes
// are held, their parents, reference counts, the inactive set and the
// eviction order. The storage behind it only places and drops a block's
// bytes. See DESIGN.md for the data flow and the trade-offs.
//
// Invariants:
//   - A pool never holds more than Capacity blocks, counting blocks still
//     being written.
//   - A referenced block (acquired for a read or a copy) is never evicted.
//   - A block is never evicted while a child of it (a block whose Parent is
//     its hash) is in the same pool: eviction takes leaves before parents.
//   - Among the blocks that may be evicted, the least recently used goes
//     first (use = registration, Acquire, a successful DiskPool.Read, or a
//     revival: a re-registration, or DiskPool.Revive).
//   - A call that fails with an error leaves the pool as it was, except that
//     a batch call keeps the blocks it completed before the error and says how
//     many (see HostPool.RegisterFrom and DiskPool.Put).
//   - Every registration publishes one STORE and every eviction one REMOVE to
//     the Sink, with the pool's tier, under the pool lock, so the order of the
//     events is the order of the changes. Each event passes kvevent.Validate.
//   - DiskPool reopened on its directory holds the blocks it held when it was
//     closed (or, after a crash, every block whose Put returned nil and that
//     was not evicted since, plus possibly some evicted just before the
//     crash, and some of a Put that did not return nil: one that failed
//     just before the crash (on a full disk, whose batch Pebble's retries
//     of the flush wrote once there was room, or in a batch written before
//     the one that failed; the Put's abort deletes them as an eviction
//     does, durable with the next flush), or one that the crash cut off
//     between its batches (a Put over 2 GiB is written in several; those
//     written before the crash are durable, under either SyncMode, though
//     the Put never returned). Each such block comes back whole, with its
//     own bytes.)
//     Entries in its key ranges that it cannot use (half a block,
//     undecodable metadata, a block Block.check refuses: a zero hash or its
//     own parent, a key of the wrong length, the blocks of a loop of
//     parents) are deleted at open.
package pool
