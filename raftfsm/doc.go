// Package raftfsm is the replicated heart of a kvrouter node: the
// hashicorp/raft state machine over the router's state, and the Node that
// runs Raft over the Pebble stores and serves the cluster's operations.
//
// Invariants:
//   - Apply is deterministic: time comes from the command, nothing reads a
//     clock or iterates a map into state; replicas that applied the same
//     entries report the same Digest.
//   - Each ApplyBatch writes every state change and the applied index into
//     one group batch (a store.StateBatch) that the FSM keeps across
//     ApplyBatch calls and commits as one ingested sstable once it holds
//     store.GroupBytes (in the background, one group at a time), and always
//     before a snapshot or Close; a restore discards it. So the state
//     database holds the state as of one applied index, never a part of an
//     entry; entries at or below the applied index are skipped, so Raft's
//     replay after a restart never double-applies.
//   - A committed entry is never refused: an undecodable one is skipped and
//     counted, a storage failure under Apply stops the node. An entry of a
//     later build (ErrLaterBuild) is not skipped either: the FSM halts at it
//     (ApplyHalt, Halted), applying neither it nor any entry after it, its
//     applied index before it, until the node restarts on a build that
//     reads it (or restores a snapshot past it).
//   - Every command is safe to apply twice (cursors, request ids, absolute
//     registrations), because a write that timed out may have committed.
//   - A snapshot stream is checked whole (counts, SHA-256) before anything
//     replaces the live state.
//
// See DESIGN.md.
package raftfsm
