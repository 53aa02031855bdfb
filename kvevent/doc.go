// Package kvevent is the event model of kvrouter: worker ranks, storage
// tiers, router events (Stored / Removed / Cleared) and the block hashing
// that places a block in the prefix tree.
//
// Invariants:
//   - The package holds no state: every function is pure.
//   - Hashes are the ones engines and other routers compute: XXH3-64 with
//     seed 1337 over little-endian u32 token ids (content hash) and over
//     le64(parent) || le64(local) (sequence hash). Test vectors pinned in
//     hash_test.go were computed with an independent implementation.
//   - An unknown medium string is an error, never a silent default.
package kvevent
