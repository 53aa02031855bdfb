// Package api is the HTTP JSON API of a kvrouter node: route decisions,
// load bookings, worker registration, event ingestion, cluster membership,
// snapshots, health and metrics. It holds no state of its own: every
// request is validated, converted to the node's types and handed to a
// Backend (a *raftfsm.Node in production).
//
// Invariants:
//   - Nothing malformed reaches the Backend: bodies are decoded strictly
//     (unknown fields, keys that are not a field's name exactly, keys given
//     twice in an object, trailing data and wrong types are refused),
//     bounded in size, and every event passes kvevent.Event.Validate first.
//   - Every error is a JSON object {"error", "reason"} with a status code
//     that a client can branch on: 400 bad input, 404 unknown thing, 408 a
//     body that did not arrive in time, 413 too large, 503 retry later (no
//     leader, overloaded, no workers), 500 a bug.
//   - A write that reaches a follower is forwarded to the leader once, with
//     its original method, path and body (so is a consistent read, GET
//     /v1/settings?consistent=true); a forwarded request that reaches a
//     follower again is answered 503 no_leader, never forwarded again, so
//     forwarding cannot loop while leadership moves.
//   - Metric labels are bounded: the route label is the registered pattern,
//     never the request path.
//   - No input makes a handler panic; a panic anyway is answered 500 and
//     logged, or, once the status went out (a stream half-way), logged and
//     the answer aborted, so that it cannot read whole.
//
// docs/api.md documents every route with examples.
package api
