// Package eventplane carries KV events from node agents to the router
// cluster over NATS: the agent side (Publisher) assigns per-rank event ids,
// keeps what is not yet acknowledged in a bounded replay buffer and resends
// it to whichever node leads; the router side (Ingester) runs on every node
// but subscribes only while its node leads, packs the requests that arrive
// within a short linger into one Raft entry, and answers each request with
// its ranks' acknowledgements after commit. A Handover moves the
// leadership off a leader whose NATS connection stays down, to a voter
// connected to NATS (handover.go). StartServer runs the embedded
// NATS server each kvrouter node carries. docs/events.md lists the subjects
// and the wire format.
//
// Invariants:
//   - An event leaves a Publisher's buffer only when a committed ack covers
//     its id (Cursor >= id), a committed rank dump replaced it, or
//     DropOldest dropped it from a full buffer (the router then reports a
//     gap and the rank heals with a dump); and with the Publisher, at
//     Close (its owner's next incarnation resyncs the rank with a dump).
//   - Re-delivery is always safe: the FSM skips ids at or below its cursor.
//   - Every request and dump carries its publisher's incarnation, a random
//     non-zero id drawn per Publisher. A rank keeps the incarnation of the
//     dump that last replaced it, and a batch of another non-zero
//     incarnation applies nothing (acknowledged Fenced): a dead
//     incarnation's request still in flight never applies after its
//     successor's dump. An unfenced request (an agent of an earlier build)
//     is not held back so: a restarted publisher whose dump is refused as
//     stale renumbers a request cap past the router's cursor, so that such
//     a request still in flight applies as duplicates after the new dump;
//     after a dump the router takes, it may still apply (docs/events.md).
//   - The Ingester acknowledges a request only after the entry that carries
//     it has committed and applied; an error reply or no reply means
//     "unknown", and the publisher resends.
//   - The decoder never panics and never allocates more than the message's
//     size justifies; malformed input gets an error reply.
package eventplane
