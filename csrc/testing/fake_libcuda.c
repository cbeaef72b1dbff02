/*
 * A stand-in for the CUDA driver (libcuda.so.1), for testing snapcore's CUDA path on
 * machines without a GPU. tests/test_native.py compiles it and puts it first on
 * LD_LIBRARY_PATH of a child process.
 *
 * "Device memory" is host memory here and copies happen at once. What it checks is the
 * driver-facing contract: the right symbols and flags, a current context wherever the
 * real driver needs one, balanced push/pop and retain/release, every stream and event
 * destroyed. It records each call in a log the test reads back:
 *   fake_cuda_log()          the calls so far, one per line
 *   fake_cuda_mark(text)     adds a line of the caller's to that log
 *   fake_cuda_state(name)    ctx_refs, streams, events, registered, depth, event_flags
 * FAKE_CUDA_FAIL=<function> makes that function fail with CUDA_ERROR_OUT_OF_MEMORY (only in
 * device <n>'s context with FAKE_CUDA_FAIL_DEVICE=<n>);
 * FAKE_CUDA_NO_DEVICE=1 makes cuInit fail with CUDA_ERROR_NO_DEVICE;
 * FAKE_CUDA_DEVICES=<n> (1 to 8, default 1) is the number of devices, each with a primary
 * context of its own; calls made in a context log it as "ctx<device>".
 * FAKE_CUDA_PCI_BUS_ID=<id> is device 0's PCI bus id (default 0000:01:00.0).
 * Built with -DFAKE_CUDA_BATCH it also has cuMemcpyBatchAsync_v2 (a CUDA 13 driver).
 * fake_cuda_alloc(ptr, size) declares a device allocation (of host memory the test owns):
 * once any is declared, a copy's device side must lie within one of them, as the real
 * driver requires (CUDA_ERROR_INVALID_VALUE otherwise), and cuMemGetAddressRange_v2
 * answers from them; before, it answers that everything is one allocation.
 * fake_cuda_state("range_queries") counts cuMemGetAddressRange_v2 calls.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum {
  SUCCESS = 0,
  INVALID_VALUE = 1,
  OUT_OF_MEMORY = 2,
  NO_DEVICE = 100,
  INVALID_DEVICE = 101,
  INVALID_CONTEXT = 201,
  INVALID_HANDLE = 400,
};

struct handle {
  char kind; /* 's' stream, 'e' event */
  int id;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char log_buf[1 << 16];
static size_t log_len;
static int next_id = 1;
static int ctx_refs, streams, events;
static long long registered;
static int event_flags = -1; /* of the last cuEventCreate */
static int range_queries;     /* cuMemGetAddressRange_v2 calls */
#define MAX_DEVICES 8
static __thread int depth;
static __thread int stack[64]; /* the devices of this thread's current contexts */
static char primary_ctx[MAX_DEVICES];

static int device_count(void) {
  const char* n = getenv("FAKE_CUDA_DEVICES");
  int count = n != NULL ? atoi(n) : 1;
  return count < 1 ? 1 : count > MAX_DEVICES ? MAX_DEVICES : count;
}

/* The device of the current context (call after NEED_CONTEXT). */
static int current(void) { return stack[depth - 1]; }

static void note(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  pthread_mutex_lock(&lock);
  if (log_len + 128 < sizeof(log_buf)) {
    log_len += (size_t)vsnprintf(log_buf + log_len, sizeof(log_buf) - log_len, fmt, ap);
    log_buf[log_len++] = '\n';
    log_buf[log_len] = '\0';
  }
  pthread_mutex_unlock(&lock);
  va_end(ap);
}

/* FAKE_CUDA_FAIL names the function; FAKE_CUDA_FAIL_DEVICE, if set, limits the failure
 * to calls made in that device's context. */
static int failing(const char* name) {
  const char* f = getenv("FAKE_CUDA_FAIL");
  const char* d = getenv("FAKE_CUDA_FAIL_DEVICE");
  if (f == NULL || strcmp(f, name) != 0) return 0;
  return d == NULL || (depth > 0 && stack[depth - 1] == atoi(d));
}

/* Handles this fake made and has not destroyed; anything else is a foreign stream. */
static struct handle* live[4096];
static int n_live;

static int is_ours(void* h) {
  int found = 0;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < n_live && !found; ++i) found = live[i] == h;
  pthread_mutex_unlock(&lock);
  return found;
}

/* "s3", "e4", or "ext:<n>" for a stream handle the fake did not create (0 = legacy). */
static const char* name_of(void* h, char* buf, size_t n) {
  if (is_ours(h)) {
    struct handle* p = (struct handle*)h;
    snprintf(buf, n, "%c%d", p->kind, p->id);
  } else {
    snprintf(buf, n, "ext:%llu", (unsigned long long)h);
  }
  return buf;
}

static struct handle* make(char kind) {
  struct handle* h = (struct handle*)malloc(sizeof *h);
  pthread_mutex_lock(&lock);
  h->kind = kind;
  h->id = next_id++;
  if (n_live < (int)(sizeof live / sizeof live[0])) live[n_live++] = h;
  pthread_mutex_unlock(&lock);
  return h;
}

/* Frees a handle of this fake; INVALID_HANDLE for anything else (or a double destroy). */
static CUresult destroy(void* h, char kind) {
  CUresult rc = INVALID_HANDLE;
  pthread_mutex_lock(&lock);
  for (int i = 0; i < n_live; ++i) {
    if (live[i] == h && live[i]->kind == kind) {
      live[i] = live[--n_live];
      free(h);
      rc = SUCCESS;
      break;
    }
  }
  pthread_mutex_unlock(&lock);
  return rc;
}

/* Device allocations the test declared (fake_cuda_alloc). */
#define MAX_ALLOCS 64
static CUdeviceptr alloc_base[MAX_ALLOCS];
static size_t alloc_size[MAX_ALLOCS];
static int n_allocs;

void fake_cuda_alloc(CUdeviceptr base, size_t size) {
  pthread_mutex_lock(&lock);
  if (n_allocs < MAX_ALLOCS) {
    alloc_base[n_allocs] = base;
    alloc_size[n_allocs++] = size;
  }
  pthread_mutex_unlock(&lock);
}

/* The declared allocation holding p: its index, or -1. */
static int alloc_of(CUdeviceptr p) {
  for (int i = 0; i < n_allocs; ++i)
    if (p >= alloc_base[i] && p < alloc_base[i] + alloc_size[i]) return i;
  return -1;
}

/* Whether [p, p + n) may be copied: within one declared allocation, or none declared. */
static int within_one(CUdeviceptr p, size_t n) {
  if (n_allocs == 0) return 1;
  int i = alloc_of(p);
  return i >= 0 && p + n <= alloc_base[i] + alloc_size[i];
}

/* A side of a batched copy (direction unknown): host memory (in no declared allocation),
 * or wholly within the declared allocation it starts in. */
static int side_ok(CUdeviceptr p, size_t n) {
  int i = alloc_of(p);
  return i < 0 || p + n <= alloc_base[i] + alloc_size[i];
}

const char* fake_cuda_log(void) { return log_buf; }

/* A line of the test's own in the log, to place host work among the driver calls. */
void fake_cuda_mark(const char* text) { note("%s", text); }

long long fake_cuda_state(const char* what) {
  if (strcmp(what, "ctx_refs") == 0) return ctx_refs;
  if (strcmp(what, "streams") == 0) return streams;
  if (strcmp(what, "events") == 0) return events;
  if (strcmp(what, "registered") == 0) return registered;
  if (strcmp(what, "depth") == 0) return depth;
  if (strcmp(what, "event_flags") == 0) return event_flags;
  if (strcmp(what, "range_queries") == 0) return range_queries;
  return -1;
}

#define NEED_CONTEXT()              \
  do {                              \
    if (depth == 0) {               \
      note("no current context!");  \
      return INVALID_CONTEXT;       \
    }                               \
  } while (0)

CUresult cuInit(unsigned int flags) {
  if (getenv("FAKE_CUDA_NO_DEVICE") != NULL) return NO_DEVICE;
  return flags == 0 ? SUCCESS : INVALID_VALUE;
}

CUresult cuDeviceGetCount(int* count) {
  *count = device_count();
  return SUCCESS;
}

CUresult cuDeviceGet(int* device, int ordinal) {
  if (ordinal < 0 || ordinal >= device_count()) return INVALID_DEVICE;
  *device = ordinal;
  return SUCCESS;
}

/* Device 0: FAKE_CUDA_PCI_BUS_ID if set; else "0000:0<device + 1>:00.0", as the driver
 * writes bus ids. */
CUresult cuDeviceGetPCIBusId(char* bus_id, int len, int device) {
  const char* id = getenv("FAKE_CUDA_PCI_BUS_ID");
  char own[32];
  if (device < 0 || device >= device_count()) return INVALID_DEVICE;
  if (bus_id == NULL || len < 13) return INVALID_VALUE;
  if (id == NULL || device != 0) {
    snprintf(own, sizeof own, "0000:%02X:00.0", device + 1);
    id = own;
  }
  snprintf(bus_id, (size_t)len, "%s", id);
  note("DeviceGetPCIBusId %d", device);
  return SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(void** ctx, int device) {
  if (device < 0 || device >= device_count()) return INVALID_DEVICE;
  __sync_fetch_and_add(&ctx_refs, 1);
  note("PrimaryCtxRetain %d", device);
  *ctx = &primary_ctx[device];
  return SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(int device) {
  if (device < 0 || device >= device_count()) return INVALID_DEVICE;
  __sync_fetch_and_sub(&ctx_refs, 1);
  note("PrimaryCtxRelease %d", device);
  return SUCCESS;
}

CUresult cuCtxPushCurrent_v2(void* ctx) {
  char* c = (char*)ctx;
  if (c < primary_ctx || c >= primary_ctx + device_count()) return INVALID_CONTEXT;
  if (depth == (int)(sizeof stack / sizeof stack[0])) return INVALID_VALUE;
  stack[depth++] = (int)(c - primary_ctx);
  return SUCCESS;
}

CUresult cuCtxPopCurrent_v2(void** ctx) {
  if (depth == 0) return INVALID_CONTEXT;
  depth--;
  if (ctx != NULL) *ctx = &primary_ctx[stack[depth]];
  return SUCCESS;
}

CUresult cuStreamCreate(void** stream, unsigned int flags) {
  NEED_CONTEXT();
  if (flags != 1) return INVALID_VALUE; /* snapcore wants CU_STREAM_NON_BLOCKING */
  struct handle* h = make('s');
  __sync_fetch_and_add(&streams, 1);
  char b[32];
  note("StreamCreate %s", name_of(h, b, sizeof b));
  *stream = h;
  return SUCCESS;
}

CUresult cuStreamDestroy_v2(void* stream) {
  char b[32];
  note("StreamDestroy %s", name_of(stream, b, sizeof b));
  if (destroy(stream, 's') != SUCCESS) return INVALID_HANDLE;
  __sync_fetch_and_sub(&streams, 1);
  return SUCCESS;
}

CUresult cuStreamSynchronize(void* stream) {
  char b[32];
  note("StreamSynchronize %s", name_of(stream, b, sizeof b));
  return SUCCESS;
}

CUresult cuStreamWaitEvent(void* stream, void* event, unsigned int flags) {
  char b1[32], b2[32];
  if (flags != 0 || !is_ours(event)) return INVALID_VALUE;
  note("StreamWaitEvent %s %s", name_of(stream, b1, sizeof b1), name_of(event, b2, sizeof b2));
  return SUCCESS;
}

CUresult cuEventCreate(void** event, unsigned int flags) {
  NEED_CONTEXT();
  event_flags = (int)flags;
  /* CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING: a host wait sleeps, no spinning. */
  if (flags != 3) return INVALID_VALUE;
  struct handle* h = make('e');
  __sync_fetch_and_add(&events, 1);
  *event = h;
  return SUCCESS;
}

CUresult cuEventRecord(void* event, void* stream) {
  char b1[32], b2[32];
  NEED_CONTEXT();
  if (!is_ours(event)) return INVALID_HANDLE;
  note("EventRecord %s %s", name_of(event, b1, sizeof b1), name_of(stream, b2, sizeof b2));
  return SUCCESS;
}

CUresult cuEventSynchronize(void* event) {
  char b[32];
  if (!is_ours(event)) return INVALID_HANDLE;
  note("EventSynchronize %s", name_of(event, b, sizeof b));
  return SUCCESS;
}

CUresult cuEventQuery(void* event) {
  return is_ours(event) ? SUCCESS : INVALID_HANDLE;
}

CUresult cuEventDestroy_v2(void* event) {
  if (destroy(event, 'e') != SUCCESS) return INVALID_HANDLE;
  __sync_fetch_and_sub(&events, 1);
  return SUCCESS;
}

CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* stream) {
  char b[32];
  NEED_CONTEXT();
  if (failing("cuMemcpyDtoHAsync")) return OUT_OF_MEMORY;
  if (!within_one(src, n)) return INVALID_VALUE;
  memcpy(dst, (const void*)src, n);
  note("MemcpyDtoHAsync %zu %s", n, name_of(stream, b, sizeof b));
  return SUCCESS;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* stream) {
  char b[32];
  NEED_CONTEXT();
  if (!within_one(dst, n)) return INVALID_VALUE;
  memcpy((void*)dst, src, n);
  note("MemcpyHtoDAsync %zu %s", n, name_of(stream, b, sizeof b));
  return SUCCESS;
}

#ifdef FAKE_CUDA_BATCH
/* Built with -DFAKE_CUDA_BATCH: a driver that has cuMemcpyBatchAsync_v2 (CUDA 13). */
struct mem_location {
  int type, id;
};
struct memcpy_attributes {
  int src_access_order;
  struct mem_location src_hint, dst_hint;
  unsigned int flags;
};

CUresult cuMemcpyBatchAsync_v2(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes,
                               size_t count, struct memcpy_attributes* attrs,
                               size_t* attrs_idxs, size_t num_attrs, void* stream) {
  char b[32];
  size_t total = 0;
  NEED_CONTEXT();
  if (failing("cuMemcpyBatchAsync")) return INVALID_VALUE;
  /* one set of attributes from copy 0, stream-ordered: what snapcore asks for */
  if (count == 0 || num_attrs != 1 || attrs_idxs[0] != 0 || attrs[0].src_access_order != 1 ||
      stream == NULL)
    return INVALID_VALUE;
  for (size_t i = 0; i < count; ++i) /* each copy's device side: within one allocation */
    if (!side_ok(srcs[i], sizes[i]) || !side_ok(dsts[i], sizes[i])) return INVALID_VALUE;
  for (size_t i = 0; i < count; ++i) {
    memcpy((void*)dsts[i], (const void*)srcs[i], sizes[i]);
    total += sizes[i];
  }
  note("MemcpyBatchAsync %zu %zu %s", count, total, name_of(stream, b, sizeof b));
  return SUCCESS;
}
#endif

CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
  NEED_CONTEXT();
  __sync_fetch_and_add(&range_queries, 1);
  if (failing("cuMemGetAddressRange")) return INVALID_VALUE;
  if (n_allocs == 0) { /* nothing declared: one allocation covers everything */
    *base = 0;
    *size = ~(size_t)0;
    return SUCCESS;
  }
  int i = alloc_of(p);
  if (i < 0) return INVALID_VALUE;
  *base = alloc_base[i];
  *size = alloc_size[i];
  return SUCCESS;
}

CUresult cuMemHostRegister_v2(void* p, size_t n, unsigned int flags) {
  NEED_CONTEXT();
  if (failing("cuMemHostRegister")) return OUT_OF_MEMORY;
  if (flags != 1 || p == NULL) return INVALID_VALUE; /* CU_MEMHOSTREGISTER_PORTABLE */
  registered += (long long)n;
  note("MemHostRegister %zu ctx%d", n, current());
  return SUCCESS;
}

CUresult cuMemHostUnregister(void* p) {
  NEED_CONTEXT();
  (void)p;
  note("MemHostUnregister ctx%d", current());
  registered = 0;
  return SUCCESS;
}

CUresult cuGetErrorName(CUresult rc, const char** name) {
  switch (rc) {
    case SUCCESS: *name = "CUDA_SUCCESS"; return SUCCESS;
    case INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; return SUCCESS;
    case OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; return SUCCESS;
    case NO_DEVICE: *name = "CUDA_ERROR_NO_DEVICE"; return SUCCESS;
    case INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; return SUCCESS;
    case INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; return SUCCESS;
    case INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; return SUCCESS;
    default: *name = NULL; return INVALID_VALUE;
  }
}

CUresult cuGetErrorString(CUresult rc, const char** text) {
  const char* name = NULL;
  CUresult r = cuGetErrorName(rc, &name);
  *text = r == SUCCESS ? "fake driver error" : NULL;
  return r;
}
