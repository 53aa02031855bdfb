// Package manager is the node agent's offload manager: it moves KV blocks
// between the engine's GPU cache (G1, a Region mapped from the engine), the
// pinned host pool (G2, pool.HostPool) and the disk pool (G3,
// pool.DiskPool), with one offload/backend.Backend doing the copies.
//
//   - Offload (write-through): a G1 block the engine registers with a
//     priority is queued for G1→G2 (D2H); without a G2 pool, for G1→G3
//     through a staging buffer (D2Disk), if the frequency filter passes it.
//   - Promotion: a G2 block seen often enough (a decaying count of Offload
//     requests and Onboards; by default twice) is queued for G2→G3 (H2Disk).
//   - Onboard: blocks are copied back into G1 blocks the engine names, from
//     G2 (H2D) or from G3 through a staging buffer (Disk2H, then H2D), within
//     a deadline; what does not make it is reported for recomputation.
//
// The pools publish every STORE and REMOVE (with their tier) themselves;
// the manager only decides what to copy, when, and whether a finished copy
// may be committed. See DESIGN.md for the data flow and the trade-offs.
//
// Invariants:
//   - Offload and Free never wait for a copy or the disk: they take the
//     manager's lock (and Offload the host pool's, for an in-memory lookup)
//     for a few map and heap operations. Each offload queue is bounded
//     (QueueCapacity blocks); when full it sheds the lowest-priority, oldest
//     task and counts it. The queues order by priority, then arrival.
//   - Queued tasks are weak references: a task never keeps a G1 block or a
//     G2 slot alive. A G1 block freed (Free, or overwritten by Onboard)
//     before its copy finished is skipped or its copy discarded, and counted;
//     a G2 block evicted before its promotion is skipped.
//   - A STORE for G2 or G3 is published only after the copy into the pool
//     has finished and the source G1 block was found, after that, still in
//     the generation the Offload saw (see Manager.Free for the guarantee
//     this gives, and what it asks of the engine).
//   - A block being copied out of G2 or G3 (onboarding, promotion) is pinned
//     in its pool (Acquire) until its copy has finished; every pin is
//     released exactly once, by whichever side ends up owning the copy.
//   - Onboard returns by its deadline. The bytes of a Loaded block are the
//     bytes stored. A copy into G1 that was not started by the deadline never
//     starts; one already running is reported TimedOut and Result.Settled
//     closes when it has finished.
//   - The frequency filter holds at most 2 × HalfLife hashes.
//   - After Close no goroutine of the manager runs and every stream, event
//     and staging buffer it made is released; the pools, the backend and the
//     G1 mapping are the caller's.
package manager
