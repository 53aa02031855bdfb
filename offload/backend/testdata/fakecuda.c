// fakecuda.c: a stand-in for libcuda.so.1 that implements, on host memory,
// the CUDA driver API functions the cuda backend binds. The tests build it
// with the system C compiler and open the cuda backend on it, so that every
// purego binding (argument order, widths, the 64-byte IPC handle passed by
// value) is exercised on machines without a GPU.
//
// It is strict where the real driver is: a call that needs a context fails
// with CUDA_ERROR_INVALID_CONTEXT unless cuCtxSetCurrent ran on the calling
// OS thread; copies must lie inside live allocations of the right kind; an
// IPC handle cannot be opened by the process that exported it. Copies are
// deferred until an event, stream or context is synchronised or queried, so
// reading a destination before its event fires sees stale bytes, as on a GPU.
//
// It is stricter than the real driver where that pins the backend's duties:
// freeing memory that a queued copy still reads or writes fails with
// CUDA_ERROR_ILLEGAL_STATE (the real cuMemFree may wait for the device, but
// the backend must not count on it), instead of finishing the copy first.
//
// Environment: FAKECUDA_NO_DEVICE=1 makes cuInit fail with
// CUDA_ERROR_NO_DEVICE.
//
// Test hooks (not CUDA; the tests bind them with purego): fakecuda_live_allocs
// and fakecuda_ctx_refs count the allocations and IPC mappings not freed and
// the primary context's retains not released; fakecuda_set_delay_us makes
// every cuCtxSetCurrent sleep that long first (outside the lock), to widen
// the windows of the tests' races; fakecuda_set_strict_thread(1) makes every
// call that needs a context fail with CUDA_ERROR_INVALID_CONTEXT unless it
// comes from the OS thread of the latest cuCtxSetCurrent (for a test with one
// caller: a context left current on a thread by an earlier call would
// otherwise hide a caller that moved to that thread).
//
// A copy of exactly FAIL_COPY_BYTES (4099) bytes fails with
// CUDA_ERROR_LAUNCH_FAILED: the tests' way to fail one copy part-way
// through a batch.

#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext;
typedef struct fake_stream *CUstream;
typedef struct fake_event *CUevent;
typedef struct {
  char reserved[64];
} CUipcMemHandle;

enum {
  SUCCESS = 0,
  INVALID_VALUE = 1,
  OUT_OF_MEMORY = 2,
  NOT_INITIALIZED = 3,
  NO_DEVICE = 100,
  INVALID_DEVICE = 101,
  INVALID_CONTEXT = 201,
  INVALID_HANDLE = 400,
  ILLEGAL_STATE = 401,
  NOT_READY = 600,
  LAUNCH_FAILED = 719,
};

#define FAIL_COPY_BYTES 4099

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static int ctx_refs;
static char the_ctx;              // its address is the primary context
static __thread void *current;    // the context current on this OS thread
static volatile int delay_us;     // fakecuda_set_delay_us
static int strict_thread;         // fakecuda_set_strict_thread
static long setter_tid;           // the OS thread of the latest cuCtxSetCurrent

#define LOCK() pthread_mutex_lock(&mu)
#define UNLOCK() pthread_mutex_unlock(&mu)
#define RET(x)  \
  do {          \
    UNLOCK();   \
    return (x); \
  } while (0)
#define NEED_CTX()                                    \
  do {                                                \
    if (!initialized) RET(NOT_INITIALIZED);           \
    if (current != &the_ctx || ctx_refs <= 0) RET(INVALID_CONTEXT); \
    if (strict_thread && syscall(SYS_gettid) != setter_tid) RET(INVALID_CONTEXT); \
  } while (0)

// ---- allocations ----------------------------------------------------------

enum { K_DEVICE = 1, K_HOST = 2, K_IPC = 3 };
struct alloc {
  uintptr_t base;
  size_t size;
  int kind;
  int fd;
};
#define MAXALLOC 4096
static struct alloc allocs[MAXALLOC];

static struct alloc *add_alloc(uintptr_t base, size_t size, int kind, int fd) {
  for (int i = 0; i < MAXALLOC; i++) {
    if (allocs[i].base == 0) {
      allocs[i] = (struct alloc){base, size, kind, fd};
      return &allocs[i];
    }
  }
  return NULL;
}

static struct alloc *find_base(uintptr_t base, int kind) {
  for (int i = 0; i < MAXALLOC; i++)
    if (allocs[i].base == base && base != 0 && allocs[i].kind == kind) return &allocs[i];
  return NULL;
}

// inside: [p, p+n) inside one allocation; device means K_DEVICE or K_IPC.
static int inside(uintptr_t p, size_t n, int want_device) {
  for (int i = 0; i < MAXALLOC; i++) {
    struct alloc *a = &allocs[i];
    if (a->base == 0) continue;
    int dev = a->kind != K_HOST;
    if (want_device >= 0 && dev != want_device) continue;
    if (p >= a->base && n <= a->size && p - a->base <= a->size - n) return 1;
  }
  return 0;
}

// ---- streams and events ---------------------------------------------------

struct op {
  void *dst;
  const void *src;
  size_t n;
};
struct fake_stream {
  int live;
  struct op *ops;
  size_t nops, cap, done;  // ops[done:nops] are pending
};
struct fake_event {
  int live;
  struct fake_stream *s;
  size_t mark;
};
#define MAXH 4096
static struct fake_stream *streams[MAXH];  // never freed: events may point at them
static struct fake_event *events[MAXH];

static int live_stream(struct fake_stream *s) {
  for (int i = 0; i < MAXH; i++)
    if (streams[i] == s && s && s->live) return 1;
  return 0;
}
static int live_event(struct fake_event *e) {
  for (int i = 0; i < MAXH; i++)
    if (events[i] == e && e && e->live) return 1;
  return 0;
}
static void run_until(struct fake_stream *s, size_t mark) {
  while (s->done < mark && s->done < s->nops) {
    struct op *o = &s->ops[s->done++];
    memmove(o->dst, o->src, o->n);
  }
}
// busy: a copy still queued on some stream reads or writes a's memory.
static int busy(const struct alloc *a) {
  for (int i = 0; i < MAXH; i++) {
    struct fake_stream *s = streams[i];
    if (!s) continue;
    for (size_t j = s->done; j < s->nops; j++) {
      uintptr_t d = (uintptr_t)s->ops[j].dst, r = (uintptr_t)s->ops[j].src;
      if ((d >= a->base && d - a->base < a->size) || (r >= a->base && r - a->base < a->size)) return 1;
    }
  }
  return 0;
}
static void run_all(void) {
  for (int i = 0; i < MAXH; i++)
    if (streams[i]) run_until(streams[i], streams[i]->nops);
}
static CUresult enqueue(CUstream s, void *dst, const void *src, size_t n) {
  if (!live_stream(s)) return INVALID_HANDLE;
  if (s->nops == s->cap) {
    size_t c = s->cap ? 2 * s->cap : 64;
    struct op *ops = realloc(s->ops, c * sizeof *ops);
    if (!ops) return OUT_OF_MEMORY;
    s->ops = ops;
    s->cap = c;
  }
  s->ops[s->nops++] = (struct op){dst, src, n};
  return SUCCESS;
}

// ---- API ------------------------------------------------------------------

CUresult cuInit(unsigned int flags) {
  LOCK();
  if (flags != 0) RET(INVALID_VALUE);
  const char *nd = getenv("FAKECUDA_NO_DEVICE");
  if (nd && strcmp(nd, "1") == 0) RET(NO_DEVICE);
  initialized = 1;
  RET(SUCCESS);
}

CUresult cuDriverGetVersion(int *v) {
  if (!v) return INVALID_VALUE;
  *v = 12040;
  return SUCCESS;
}

CUresult cuDeviceGetCount(int *n) {
  LOCK();
  if (!initialized) RET(NOT_INITIALIZED);
  if (!n) RET(INVALID_VALUE);
  *n = 1;
  RET(SUCCESS);
}

CUresult cuDeviceGet(CUdevice *d, int ordinal) {
  LOCK();
  if (!initialized) RET(NOT_INITIALIZED);
  if (!d) RET(INVALID_VALUE);
  if (ordinal != 0) RET(INVALID_DEVICE);
  *d = 0;
  RET(SUCCESS);
}

CUresult cuDeviceGetName(char *name, int len, CUdevice d) {
  LOCK();
  if (!initialized) RET(NOT_INITIALIZED);
  if (!name || len <= 0) RET(INVALID_VALUE);
  if (d != 0) RET(INVALID_DEVICE);
  snprintf(name, (size_t)len, "Fake CUDA Device");
  RET(SUCCESS);
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice d) {
  LOCK();
  if (!initialized) RET(NOT_INITIALIZED);
  if (!ctx) RET(INVALID_VALUE);
  if (d != 0) RET(INVALID_DEVICE);
  ctx_refs++;
  *ctx = &the_ctx;
  RET(SUCCESS);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
  LOCK();
  if (d != 0) RET(INVALID_DEVICE);
  if (ctx_refs <= 0) RET(INVALID_CONTEXT);
  ctx_refs--;
  RET(SUCCESS);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  if (delay_us > 0) usleep((useconds_t)delay_us);
  LOCK();
  if (ctx != NULL && ctx != &the_ctx) RET(INVALID_CONTEXT);
  current = ctx;
  setter_tid = syscall(SYS_gettid);
  RET(SUCCESS);
}

CUresult cuCtxSynchronize(void) {
  LOCK();
  NEED_CTX();
  run_all();
  RET(SUCCESS);
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t size) {
  LOCK();
  NEED_CTX();
  if (!dptr || size == 0) RET(INVALID_VALUE);
  int fd = memfd_create("fakecuda", MFD_CLOEXEC);
  if (fd < 0) RET(OUT_OF_MEMORY);
  if (ftruncate(fd, (off_t)size) != 0) {
    close(fd);
    RET(OUT_OF_MEMORY);
  }
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    close(fd);
    RET(OUT_OF_MEMORY);
  }
  if (!add_alloc((uintptr_t)p, size, K_DEVICE, fd)) {
    munmap(p, size);
    close(fd);
    RET(OUT_OF_MEMORY);
  }
  *dptr = (CUdeviceptr)(uintptr_t)p;
  RET(SUCCESS);
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
  LOCK();
  NEED_CTX();
  struct alloc *a = find_base((uintptr_t)dptr, K_DEVICE);
  if (!a) RET(INVALID_VALUE);
  if (busy(a)) RET(ILLEGAL_STATE);
  munmap((void *)a->base, a->size);
  close(a->fd);
  *a = (struct alloc){0};
  RET(SUCCESS);
}

CUresult cuMemHostAlloc(void **pp, size_t size, unsigned int flags) {
  LOCK();
  NEED_CTX();
  if (!pp || size == 0 || (flags & ~0xfu)) RET(INVALID_VALUE);
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) RET(OUT_OF_MEMORY);
  if (!add_alloc((uintptr_t)p, size, K_HOST, -1)) {
    munmap(p, size);
    RET(OUT_OF_MEMORY);
  }
  *pp = p;
  RET(SUCCESS);
}

CUresult cuMemFreeHost(void *p) {
  LOCK();
  NEED_CTX();
  struct alloc *a = find_base((uintptr_t)p, K_HOST);
  if (!a) RET(INVALID_VALUE);
  if (busy(a)) RET(ILLEGAL_STATE);
  munmap((void *)a->base, a->size);
  *a = (struct alloc){0};
  RET(SUCCESS);
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *pbase, size_t *psize, CUdeviceptr dptr) {
  LOCK();
  NEED_CTX();
  for (int i = 0; i < MAXALLOC; i++) {
    struct alloc *a = &allocs[i];
    if (a->base == 0 || a->kind == K_HOST) continue;
    if (dptr >= a->base && dptr - a->base < a->size) {
      if (pbase) *pbase = a->base;
      if (psize) *psize = a->size;
      RET(SUCCESS);
    }
  }
  RET(INVALID_VALUE);
}

CUresult cuStreamCreate(CUstream *ps, unsigned int flags) {
  LOCK();
  NEED_CTX();
  if (!ps || flags > 1) RET(INVALID_VALUE);
  for (int i = 0; i < MAXH; i++) {
    if (streams[i] == NULL) {
      streams[i] = calloc(1, sizeof(struct fake_stream));
      if (!streams[i]) RET(OUT_OF_MEMORY);
      streams[i]->live = 1;
      *ps = streams[i];
      RET(SUCCESS);
    }
  }
  RET(OUT_OF_MEMORY);
}

CUresult cuStreamDestroy_v2(CUstream s) {
  LOCK();
  NEED_CTX();
  if (!live_stream(s)) RET(INVALID_HANDLE);
  s->live = 0;  // queued work still completes, at the next synchronisation
  RET(SUCCESS);
}

CUresult cuStreamSynchronize(CUstream s) {
  LOCK();
  NEED_CTX();
  if (!live_stream(s)) RET(INVALID_HANDLE);
  run_until(s, s->nops);
  RET(SUCCESS);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) {
  LOCK();
  NEED_CTX();
  if (n == FAIL_COPY_BYTES) RET(LAUNCH_FAILED);
  if (!inside((uintptr_t)dst, n, 0) || !inside((uintptr_t)src, n, 1)) RET(INVALID_VALUE);
  RET(enqueue(s, dst, (const void *)(uintptr_t)src, n));
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
  LOCK();
  NEED_CTX();
  if (n == FAIL_COPY_BYTES) RET(LAUNCH_FAILED);
  if (!inside((uintptr_t)dst, n, 1) || !inside((uintptr_t)src, n, 0)) RET(INVALID_VALUE);
  RET(enqueue(s, (void *)(uintptr_t)dst, src, n));
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  LOCK();
  NEED_CTX();
  if (n == FAIL_COPY_BYTES) RET(LAUNCH_FAILED);
  if (!inside((uintptr_t)dst, n, 1) || !inside((uintptr_t)src, n, 1)) RET(INVALID_VALUE);
  RET(enqueue(s, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n));
}

CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
  LOCK();
  NEED_CTX();
  if (n == FAIL_COPY_BYTES) RET(LAUNCH_FAILED);
  if (!inside((uintptr_t)dst, n, -1) || !inside((uintptr_t)src, n, -1)) RET(INVALID_VALUE);
  RET(enqueue(s, (void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n));
}

CUresult cuEventCreate(CUevent *pe, unsigned int flags) {
  LOCK();
  NEED_CTX();
  if (!pe || (flags & ~0x7u)) RET(INVALID_VALUE);
  for (int i = 0; i < MAXH; i++) {
    if (events[i] == NULL || !events[i]->live) {
      if (events[i] == NULL) events[i] = calloc(1, sizeof(struct fake_event));
      if (!events[i]) RET(OUT_OF_MEMORY);
      *events[i] = (struct fake_event){1, NULL, 0};
      *pe = events[i];
      RET(SUCCESS);
    }
  }
  RET(OUT_OF_MEMORY);
}

CUresult cuEventRecord(CUevent e, CUstream s) {
  LOCK();
  NEED_CTX();
  if (!live_event(e) || !live_stream(s)) RET(INVALID_HANDLE);
  e->s = s;
  e->mark = s->nops;
  RET(SUCCESS);
}

// cuEventQuery makes progress one copy per call, so that callers see
// CUDA_ERROR_NOT_READY before the event fires.
CUresult cuEventQuery(CUevent e) {
  LOCK();
  NEED_CTX();
  if (!live_event(e)) RET(INVALID_HANDLE);
  if (!e->s || e->s->done >= e->mark) RET(SUCCESS);
  run_until(e->s, e->s->done + 1);
  RET(NOT_READY);
}

CUresult cuEventSynchronize(CUevent e) {
  LOCK();
  NEED_CTX();
  if (!live_event(e)) RET(INVALID_HANDLE);
  if (e->s) run_until(e->s, e->mark);
  RET(SUCCESS);
}

CUresult cuEventDestroy_v2(CUevent e) {
  LOCK();
  NEED_CTX();
  if (!live_event(e)) RET(INVALID_HANDLE);
  e->live = 0;
  RET(SUCCESS);
}

struct fake_ipc {
  char magic[8];
  int32_t pid, fd;
  uint64_t size;
};

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr dptr) {
  LOCK();
  NEED_CTX();
  struct alloc *a = find_base((uintptr_t)dptr, K_DEVICE);
  if (!h || !a) RET(INVALID_VALUE);
  memset(h, 0, sizeof *h);
  struct fake_ipc f = {{'F', 'A', 'K', 'E', 'C', 'U', 'D', 'A'}, getpid(), a->fd, a->size};
  memcpy(h->reserved, &f, sizeof f);
  RET(SUCCESS);
}

CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *dptr, CUipcMemHandle h, unsigned int flags) {
  LOCK();
  NEED_CTX();
  struct fake_ipc f;
  memcpy(&f, h.reserved, sizeof f);
  if (!dptr || flags > 1 || memcmp(f.magic, "FAKECUDA", 8) != 0) RET(INVALID_VALUE);
  for (size_t i = sizeof f; i < sizeof h.reserved; i++)
    if (h.reserved[i] != 0) RET(INVALID_VALUE);
  if (f.pid == getpid()) RET(INVALID_CONTEXT);  // like CUDA: not in the exporting process
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)f.pid, (int)f.fd);
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) RET(INVALID_VALUE);
  void *p = mmap(NULL, f.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) RET(OUT_OF_MEMORY);
  if (!add_alloc((uintptr_t)p, f.size, K_IPC, -1)) {
    munmap(p, f.size);
    RET(OUT_OF_MEMORY);
  }
  *dptr = (CUdeviceptr)(uintptr_t)p;
  RET(SUCCESS);
}

CUresult cuIpcCloseMemHandle(CUdeviceptr dptr) {
  LOCK();
  NEED_CTX();
  struct alloc *a = find_base((uintptr_t)dptr, K_IPC);
  if (!a) RET(INVALID_VALUE);
  if (busy(a)) RET(ILLEGAL_STATE);
  munmap((void *)a->base, a->size);
  *a = (struct alloc){0};
  RET(SUCCESS);
}

static const char *names[][2] = {
    {"CUDA_SUCCESS", "no error"},
    {"CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {"CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {"CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
};

static CUresult describe(CUresult code, const char **p, int which) {
  if (!p) return INVALID_VALUE;
  if (code >= 0 && code <= 3) {
    *p = names[code][which];
    return SUCCESS;
  }
  switch (code) {
    case NO_DEVICE: *p = which ? "no CUDA-capable device is detected" : "CUDA_ERROR_NO_DEVICE"; return SUCCESS;
    case INVALID_DEVICE: *p = which ? "invalid device ordinal" : "CUDA_ERROR_INVALID_DEVICE"; return SUCCESS;
    case INVALID_CONTEXT: *p = which ? "invalid device context" : "CUDA_ERROR_INVALID_CONTEXT"; return SUCCESS;
    case ILLEGAL_STATE: *p = which ? "the operation is not permitted in the current state" : "CUDA_ERROR_ILLEGAL_STATE"; return SUCCESS;
    case INVALID_HANDLE: *p = which ? "invalid resource handle" : "CUDA_ERROR_INVALID_HANDLE"; return SUCCESS;
    case NOT_READY: *p = which ? "device not ready" : "CUDA_ERROR_NOT_READY"; return SUCCESS;
    case LAUNCH_FAILED: *p = which ? "unspecified launch failure" : "CUDA_ERROR_LAUNCH_FAILED"; return SUCCESS;
  }
  *p = NULL;
  return INVALID_VALUE;
}

CUresult cuGetErrorName(CUresult code, const char **p) { return describe(code, p, 0); }
CUresult cuGetErrorString(CUresult code, const char **p) { return describe(code, p, 1); }

// ---- test hooks -------------------------------------------------------------

int fakecuda_live_allocs(void) {
  LOCK();
  int n = 0;
  for (int i = 0; i < MAXALLOC; i++)
    if (allocs[i].base != 0) n++;
  RET(n);
}

int fakecuda_ctx_refs(void) {
  LOCK();
  RET(ctx_refs);
}

void fakecuda_set_delay_us(int us) { delay_us = us; }

void fakecuda_set_strict_thread(int on) {
  LOCK();
  strict_thread = on;
  UNLOCK();
}
