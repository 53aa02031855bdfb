// Package sim replays request traces against simulated inference workers
// and routing policies, to measure what KV-aware routing wins
// (docs/sim.md).
//
// A trace (Mooncake format, 512-token prefix-block ids) is expanded into
// engine-sized blocks of deterministic synthetic tokens, so that the real
// hashing path runs. Each simulated worker keeps a KV cache with
// leaf-first LRU eviction and reports every block it stores or evicts as a
// router event, exactly as an engine would; policies route each request
// from what they have seen.
//
// Three replays share the trace, the caches and the policies:
//   - RunTimed: a discrete-event simulation of Engines (a vLLM-like
//     scheduler with a token budget, chunked prefill, a running limit and
//     preemption, over a finite KV cache, timed by the prefill and decode
//     model of Timing), open or closed loop;
//   - RunCacheOnly: time-free, count the cached prefix on the chosen
//     worker and insert;
//   - Replay: the first model (no queue), kept for the live policy Remote,
//     which routes through a running cluster. There the workers can publish
//     their events on real engine wires (WithWire, WireFleet, AppendBatch;
//     the ZMQ sockets in sim/enginepub) for node agents to bring to the
//     cluster, as vLLM engines do.
//
// Invariants:
//   - Everything is deterministic for a given trace, configuration and seed:
//     simulated time only, no wall clock, no map iteration in decisions.
//   - A worker never evicts a block that an in-flight request uses, nor a
//     block before its descendants.
//   - A worker's events reach the policy in the order it produced them,
//     with consecutive event ids, so an index fed by them holds exactly
//     what the worker holds.
package sim
