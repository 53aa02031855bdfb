// Package raftfsm is the replicated heart of a kvrouter node: the
// hashicorp/raft state machine over the router's state, and the Node that
// runs Raft over the Pebble stores and serves the cluster's operations.
//
// Invariants:
//   - Apply is deterministic: time comes from the command, nothing reads a
//     clock or iterates a map into state; replicas that applied the same
//     entries report the same Digest.
//   - Each ApplyBatch is one Pebble batch that carries every state change
//     and the applied index; entries at or below the applied index are
//     skipped, so Raft's replay after a restart never double-applies.
//   - A committed entry is never refused: an undecodable one is skipped and
//     counted, a storage failure under Apply stops the node.
//   - Every command is safe to apply twice (cursors, request ids, absolute
//     registrations), because a write that timed out may have committed.
//   - A snapshot stream is checked whole (counts, SHA-256) before anything
//     replaces the live state.
//
// See DESIGN.md.
package raftfsm
