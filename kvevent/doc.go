// Package kvevent is the event model of kvrouter: worker ranks, storage
// tiers, router events (Stored / Removed / Cleared) and the block hashing
// that places a block in the prefix tree.
//
// Invariants:
//   - Every function is deterministic: its result depends on its arguments
//     alone, the same on every replica and in every process. The only
//     package-level state is read-only tables (tier names, the medium
//     map, the errors) and, for Event.Validate's check of repeated hashes
//     in a long chain, a sync.Pool of hash tables and the random seed
//     mixed into their slots: they change how fast, never what, it answers.
//   - Hashes are the ones engines and other routers compute: XXH3-64 with
//     seed 1337 over little-endian u32 token ids (content hash) and over
//     le64(parent) || le64(local) (sequence hash). Test vectors pinned in
//     hash_test.go were computed with an independent implementation.
//   - An unknown medium string is an error, never a silent default.
package kvevent
