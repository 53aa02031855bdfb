// Package backend copies KV blocks between memory tiers: GPU memory (G1),
// pinned host memory (G2) and, through the host, the disk tier (G3).
//
// Two implementations share one contract, the Backend interface:
//
//   - cuda: the CUDA driver API, loaded at run time from libcuda.so.1 with
//     purego. Building it needs no CUDA toolkit and no cgo; a machine without
//     the driver simply cannot open it (ErrNoCUDA).
//   - host: plain host memory and copy(), one worker goroutine per stream. It
//     runs everywhere and stands in for a GPU in tests and on GPU-less nodes.
//
// Open(KindAuto) picks cuda when the driver loads and reports a device, host
// otherwise.
//
// Invariants:
//   - Every Ptr given to a copy lies, with its length, inside one live region
//     of the same backend (AllocDevice, AllocHost or OpenIPCHandle). A copy
//     that does not is refused with an error before anything is queued, so a
//     bad argument is an error, never a crash.
//   - The same holds when another process shrinks the file behind a host
//     region from OpenIPCHandle: the copy fails with ErrFault (before it is
//     queued when the file is already short, from the event after it when
//     the file shrinks under it); the process and the stream live on.
//     On the host backend a file removed from its path (an engine that
//     re-creates it by unlink and create) fails copies with ErrFault before
//     they are queued as well, unless it had no name when mapped (a memfd).
//   - Copies on one stream run in the order they were queued; an event
//     recorded on a stream fires only after every copy queued before it has
//     finished, and its bytes are then visible to the host.
//   - Copies on different streams may run concurrently and in any order.
//   - After Close, every other method that can fail returns ErrClosed (Kind
//     and Name still answer), no goroutine of the backend is left running
//     and every region it handed out is released. Close is idempotent: a
//     second Close returns nil.
//
// The cuda backend binds the device's primary context to the calling OS
// thread on every call (see CUDA.enter), so any goroutine may call any
// method at any time; nothing here needs the caller to lock an OS thread.
package backend
