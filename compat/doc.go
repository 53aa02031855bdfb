// Package compat serves the drop-in HTTP APIs that other KV-aware stacks
// call (the KV-indexer API of Dynamo's standalone indexer, docs/compat.md)
// from kvrouter's replicated state, beside the node's own /v1 API.
//
// Invariants:
//
//   - Every write (register, unregister, events) goes through Raft like a
//     /v1 write; a follower forwards it to the leader (api.Server's
//     middleware), so every replica answers a read the same way once it
//     has applied the same log.
//   - A (model, tenant) pair is a namespace: an instance registered for it
//     is a kvrouter worker of id WorkerID(instance, model, tenant), so a
//     tenant's events never touch another's state and a query of one
//     namespace scores only its own ranks.
//   - A bad request is answered {"error": ...} with a 4xx status and
//     changes nothing. There is no authentication (docs/compat.md).
//   - Bodies are JSON or MessagePack; the answer uses the request's
//     encoding, and map keys are sorted so that equal answers are equal
//     bytes.
package compat
