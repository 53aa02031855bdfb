// Package sim replays request traces against simulated inference workers
// and routing policies, to measure what KV-aware routing wins.
//
// A trace (Mooncake format, 512-token prefix-block ids) is expanded into
// engine-sized blocks of deterministic synthetic tokens, so that the real
// hashing path runs. Each simulated worker keeps a KV cache with
// leaf-first LRU eviction and reports every block it stores or evicts as a
// router event, exactly as an engine would; policies route each request
// from what they have seen.
//
// Invariants:
//   - Everything is deterministic for a given trace, configuration and seed:
//     simulated time only, no wall clock, no map iteration in decisions.
//   - A worker never evicts a block that an in-flight request uses, nor a
//     block before its descendants.
package sim
