// Package indexer keeps, for every worker rank, which KV blocks it holds in
// which storage tier, and answers prefix-overlap queries against that state.
// It also scores ranks for a request and tracks their in-flight load.
//
// The index is a radix tree over block content hashes: a node is one block
// position of one distinct prefix, its children are keyed by the next
// block's content hash, and each node lists the ranks that hold it with a
// residency bitmask over the four tiers. Per rank, a map from the engine's
// block hash to the node resolves parents and removes in O(1).
//
// Invariants:
//   - A tree node exists only while some rank holds it or one of its
//     descendants: the last holder leaving a childless node unlinks it.
//   - For every rank, engine hash h maps to node n exactly when n lists the
//     rank with engine hash h and a non-empty mask (a bijection).
//   - Applying the same events in the same order gives the same Digest, and
//     equal residencies and held orphans give equal Digests whatever the
//     history (the Digest covers only those: see digest.go).
//   - Nothing here reads a clock, a file or the network: time is an argument.
//   - Malformed input is rejected whole with an error wrapping
//     kvevent.ErrMalformed and changes nothing.
//
// See DESIGN.md for the concurrency model and the trade-offs.
package indexer
