// Package engineapi is the node agent's engine-facing offload API: HTTP/JSON
// over a Unix socket, in front of one offload/manager.Manager per dp rank.
// docs/offload.md documents the endpoints with examples; api.go holds the
// request and response types, which the Go Client uses as they are.
//
// An engine registers its G1 KV cache region (a CUDA IPC memory handle, or
// with the host backend the path of a shared-memory file, and the block
// layout); the server maps it (manager.MapRegion) and starts that rank's
// Manager on the rank's pools, which the caller made (G2 host pool, G3 disk
// pool) and which stay the caller's. The engine then offloads, frees, looks
// up and onboards blocks by G1 block id and block hash.
//
// Invariants:
//   - A request that is refused (a 4xx answer) changed nothing: a request is
//     checked whole (every block id, every hash, every length and, with a
//     Config.Checker, every offload block against the engine's own events)
//     before the Manager sees it, so a batch is never applied in part.
//   - Offload and Free never wait for a copy, the disk or another request's
//     copy: they are the Manager's non-blocking calls. The engine path never
//     blocks behind a stalled backend; a full queue sheds (and says so).
//   - An onboard answer is its completion: unless it says settled=false, no
//     copy this onboard started writes into G1 after the answer.
//   - Registering a region for a rank that has one replaces it: every G1
//     block of the old region counts as freed (no STORE comes from a copy
//     of it that finishes later), its Manager is closed (copies in flight
//     finish) and its mapping closed, before the new Manager starts. Two
//     Managers never run on one rank's pools at once.
//   - After Close the socket is gone, no handler runs, every Manager is
//     closed and every mapping unmapped; the pools and the backend are the
//     caller's to close afterwards.
package engineapi
