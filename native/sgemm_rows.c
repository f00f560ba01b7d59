/* Products of a few rows, in front of OpenBLAS's cblas_sgemm.

MLX's CPU backend calls cblas_sgemm for every matmul, also for a decode step's few rows of
activations (one per request). OpenBLAS 0.3.21 (Debian 12) packs both operands for sgemm
however few the rows, and spends more time packing than multiplying. Over a model's layer
products (float32 weights [out, in]), dot_rows below beat OpenBLAS's sgemm at every row
count up to ROWS (by the most at one row), and one OpenBLAS sgemv a row wherever that was
measured (docs/BENCHMARKS.md, "Figures behind the code").

So a product of at most ROWS rows against a weight stored [out, in] (x @ W.T, the
transposed-B call) runs dot_rows: each weight row is read once, as a stream, and dotted
with every activation row, the output columns split among this library's threads. Against
a weight stored [in, out] (x @ W: the output head) one row goes to OpenBLAS's sgemv, whose
kernel reads that layout as fast, and 2 to ROWS rows run panel_rows, which reads the weight
once for all of them (OpenBLAS's sgemm or one sgemv a row read it once a row), where it has
PANEL_COLUMNS columns or more: a narrower one goes to OpenBLAS's sgemm, as attention's
weights @ values does (a few rows against [context, 64] per KV head, every layer of every
decode step), which panel_rows took 3-10x OpenBLAS's time over (its per-row setup spans the
whole depth, whatever the width: 39 against 13 us at 3 rows x 600 x 64, 191 against 18 at
12 rows; 74 against 59 at 2 x 576 x 576; it led from 1,536 columns, 160 against 322 us at
2 rows; docs/BENCHMARKS.md, "Figures behind the code"). A speculative
step (a row's next token and its proposals) is such a product: its rows took less time
than OpenBLAS's on a 49152 x 576 head [in, out], and far less than their number times one
row's on a 1536 x 576 layer [out, in] (docs/BENCHMARKS.md, "Figures behind the code").
Other few-row products (A transposed) make one OpenBLAS sgemv a row up to SGEMV_ROWS rows,
and everything else goes on to OpenBLAS. Results differ from sgemm's by summation order only.

Threads: as many as OpenBLAS's own (OPENBLAS_NUM_THREADS, which launcher/cpu_layer.py sets
per rank), the caller and helpers that spin for 200 us after a product (the next one of a
step comes sooner) and then sleep on a futex; they share a product's columns by chunks.

Built with -march=native on each host and preloaded before OpenBLAS by
launcher/cpu_layer.py, on Linux x86_64 hosts where MLX computes on its CPU device (unless
NATIVE_KERNELS=off). The products it does not take over go to the cblas_sgemm that follows
it in the process (OpenBLAS), found when the library loads, or at the first such product
where that library was loaded later; where there is none, that product stops the process
with a message that says so (it could not be computed).
*/
#define _GNU_SOURCE
#include <dlfcn.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { ROW_MAJOR = 101, COL_MAJOR = 102, NO_TRANS = 111, TRANS = 112 };
enum { ROWS = 16, SGEMV_ROWS = 4, MAX_THREADS = 16, PANEL_COLUMNS = 1024 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static _Atomic(sgemm_fn) next_sgemm;
static sgemv_fn next_sgemv;
static int threads = 1;
/* products this library computed itself, and chunks of them its helper threads computed:
   the tests read them to see the library and its pool at work */
unsigned long mlx_ring_sgemm_rows_calls, mlx_ring_sgemm_rows_helped;

/* ---- the kernel: C[i, n] = alpha * A[i, :] . B[n, :] + beta * C[i, n] ---------------- */

/* One vector register's floats, and the rows of A a block takes: 2 x BLOCK accumulators, two
   weight vectors and one row's vector stay in the registers (16 on AVX2, 32 on AVX-512).
   With 16-float vectors on AVX2 (two registers each) 5 rows spilled, and a product of 5
   rows cost several times one row. On AVX-512 a block takes 12 rows (26 registers), so a
   speculative step of 9 positions reads each weight once: with blocks of 8 it read them
   twice, and 9 rows cost 1.2-1.45x 8 (docs/BENCHMARKS.md, "Figures behind the code"). */
#if defined(__AVX512F__)
typedef float vec __attribute__((vector_size(64), aligned(4)));
enum { LANES = 16, BLOCK = 12 };
#else
typedef float vec __attribute__((vector_size(32), aligned(4)));
enum { LANES = 8, BLOCK = 6 };
#endif
/* The weight rows a block asks the memory for before it reads them: the hardware's
   prefetcher alone let a product of several rows wait on memory between its bursts of
   arithmetic (one core, 1536 x 576 weights past the caches: 5 rows 500 us, 8 rows 600,
   where 1 row streams them in 260; with these hints 260 and 330). Into L2 (T1): into L1
   read slower. */
enum { DOT_AHEAD = 6, PANEL_AHEAD = 4 };
#define FETCH(address) __builtin_prefetch((address), 0, 2)
typedef float v4 __attribute__((vector_size(16), aligned(4)));

static inline __attribute__((always_inline)) float lanes_sum(vec v) {
  float total = 0;
  for (int i = 0; i < LANES; i += 4) {
    v4 q;
    __builtin_memcpy(&q, (const float *)&v + i, sizeof q);
    total += (q[0] + q[2]) + (q[1] + q[3]);
  }
  return total;
}

/* M (a constant in each instance) rows of A against weight rows [n0, n1), two at a time */
static inline __attribute__((always_inline)) void dot_block(
    const int M, int n0, int n1, int k, float alpha, const float *a, int lda,
    const float *b, int ldb, float beta, float *c, int ldc) {
  for (int n = n0; n < n1; n += 2) {
    int two = n + 1 < n1;
    const float *b0 = b + (long)n * ldb, *b1 = two ? b0 + ldb : b0;
    /* fixed size: GCC keeps these in registers, and kept a variable-length [M] on the stack */
    vec acc0[BLOCK], acc1[BLOCK];
    for (int i = 0; i < M; i++) acc0[i] = acc1[i] = (vec){0};
    int t = 0;
    for (; t + LANES <= k; t += LANES) {
      vec w0 = *(const vec *)(b0 + t), w1 = *(const vec *)(b1 + t);
      if (n + DOT_AHEAD + 1 < n1) {
        FETCH(b0 + (long)DOT_AHEAD * ldb + t);
        FETCH(b0 + (long)(DOT_AHEAD + 1) * ldb + t);
      }
      for (int i = 0; i < M; i++) {
        vec x = *(const vec *)(a + (long)i * lda + t);
        acc0[i] += x * w0;
        acc1[i] += x * w1;
      }
    }
    for (int i = 0; i < M; i++) {
      const float *x = a + (long)i * lda;
      float s0 = lanes_sum(acc0[i]), s1 = lanes_sum(acc1[i]);
      for (int u = t; u < k; u++) {
        s0 += x[u] * b0[u];
        s1 += x[u] * b1[u];
      }
      float *y = c + (long)i * ldc;
      y[n] = alpha * s0 + (beta != 0 ? beta * y[n] : 0);
      if (two) y[n + 1] = alpha * s1 + (beta != 0 ? beta * y[n + 1] : 0);
    }
  }
}

/* M rows of A against a weight stored [k, n] (x @ W, B not transposed), columns [n0, n1):
   C's block stays in the cache while four weight rows at a time stream through it, each
   read once for all M rows (a panel of columns down all k rows instead strode through
   576 pages and was slower than OpenBLAS). */
static inline __attribute__((always_inline)) void panel_block(
    const int M, int n0, int n1, int k, float alpha, const float *a, int lda,
    const float *b, int ldb, float beta, float *c, int ldc) {
  for (int i = 0; i < M; i++) {
    float *y = c + (long)i * ldc;
    for (int n = n0; n < n1; n++) y[n] = beta != 0 ? beta * y[n] : 0;
  }
  for (int t = 0; t < k; t += 4) {
    int rows = k - t < 4 ? k - t : 4;
    float x[BLOCK][4];
    const float *w[4];
    for (int j = 0; j < 4; j++) {
      w[j] = b + (long)(j < rows ? t + j : t) * ldb;
      for (int i = 0; i < M; i++) x[i][j] = j < rows ? alpha * a[(long)i * lda + t + j] : 0;
    }
    int n = n0;
    for (; n + LANES <= n1; n += LANES) {
      vec v0 = *(const vec *)(w[0] + n), v1 = *(const vec *)(w[1] + n);
      vec v2 = *(const vec *)(w[2] + n), v3 = *(const vec *)(w[3] + n);
      if (t + PANEL_AHEAD + 3 < k)
        for (int j = 0; j < 4; j++) FETCH(w[j] + (long)PANEL_AHEAD * ldb + n);
      for (int i = 0; i < M; i++) {
        vec *y = (vec *)(c + (long)i * ldc + n);
        *y += (x[i][0] * v0 + x[i][1] * v1) + (x[i][2] * v2 + x[i][3] * v3);
      }
    }
    for (; n < n1; n++)
      for (int i = 0; i < M; i++)
        c[(long)i * ldc + n] +=
            (x[i][0] * w[0][n] + x[i][1] * w[1][n]) + (x[i][2] * w[2][n] + x[i][3] * w[3][n]);
  }
}

/* m rows in blocks of BLOCK, each block's row count a constant to the kernel it runs */
static inline __attribute__((always_inline)) void in_blocks(
    int panel, int m, int n0, int n1, int k, float alpha, const float *a, int lda,
    const float *b, int ldb, float beta, float *c, int ldc) {
  for (; m > 0; m -= BLOCK, a += (long)BLOCK * lda, c += (long)BLOCK * ldc) {
    switch (m < BLOCK ? m : BLOCK) {
#define ROWS_CASE(R)                                                      \
  case R:                                                                 \
    if (panel) panel_block(R, n0, n1, k, alpha, a, lda, b, ldb, beta, c, ldc); \
    else dot_block(R, n0, n1, k, alpha, a, lda, b, ldb, beta, c, ldc);    \
    break;
      ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
      ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
      ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
#undef ROWS_CASE
    }
  }
}

static void dot_rows(int m, int n0, int n1, int k, float alpha, const float *a, int lda,
                     const float *b, int ldb, float beta, float *c, int ldc) {
  in_blocks(0, m, n0, n1, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

static void panel_rows(int m, int n0, int n1, int k, float alpha, const float *a, int lda,
                       const float *b, int ldb, float beta, float *c, int ldc) {
  in_blocks(1, m, n0, n1, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

typedef void (*rows_kernel)(int, int, int, int, float, const float *, int, const float *, int,
                            float, float *, int);

/* ---- the helpers: one product at a time, its columns in chunks ----------------------

The caller and the helpers claim chunks of columns until none is left; the caller then
waits only for chunks a helper is computing. A helper that is not on a core (the cores
busy with other processes) takes nothing, and the caller computes alone instead of
waiting for it. Waiting helpers yield the core between spins: without that, a helper
spinning through a step kept api.py off the second core, and a client's tokens came
further apart (docs/BENCHMARKS.md, "Figures behind the code"). */

#if defined(__x86_64__) || defined(__i386__)
#define RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define RELAX() __asm__ volatile("yield")
#else
#define RELAX() ((void)0)
#endif

enum { CHUNKS_PER_THREAD = 4, MIN_CHUNK = 32 };

static struct {
  rows_kernel kernel;
  int m, n, k, lda, ldb, ldc, per_chunk;
  float alpha, beta;
  const float *a, *b;
  float *c;
} job;
/* (product << 32) | (chunks << 16) | next chunk: a claim checks its own product's count,
   which no other product's setup can change under it */
static _Atomic unsigned long long claim;
static atomic_uint posted, done_chunks, sleepers;
static atomic_flag busy = ATOMIC_FLAG_INIT;
static int helpers_up;

/* the chunks of `product` this thread computed */
static unsigned run_chunks(unsigned product) {
  for (unsigned mine = 0;;) {
    unsigned long long now = atomic_load(&claim);
    unsigned chunk = (unsigned)(now & 0xffff), chunks = (unsigned)(now >> 16) & 0xffff;
    if ((unsigned)(now >> 32) != product || chunk >= chunks) return mine;
    if (!atomic_compare_exchange_weak(&claim, &now, now + 1)) continue;
    /* claimed: the job stays this product's until its chunks are all done */
    int n0 = (int)chunk * job.per_chunk, n1 = n0 + job.per_chunk;
    job.kernel(job.m, n0, n1 < job.n ? n1 : job.n, job.k, job.alpha, job.a, job.lda, job.b,
             job.ldb, job.beta, job.c, job.ldc);
    atomic_fetch_add(&done_chunks, 1);
    mine++;
  }
}

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static void *helper(void *unused) {
  (void)unused;
  unsigned seen = 0;
  for (;;) {
    double spin_until = seconds() + 200e-6;
    while (atomic_load(&posted) == seen) {
      for (int i = 0; i < 64 && atomic_load_explicit(&posted, memory_order_relaxed) == seen; i++)
        RELAX();
      sched_yield(); /* api.py and rank 0's other threads get this core when they need it */
      if (atomic_load(&posted) == seen && seconds() > spin_until) {
        atomic_fetch_add(&sleepers, 1);
        if (atomic_load(&posted) == seen)
          syscall(SYS_futex, &posted, FUTEX_WAIT_PRIVATE, seen, 0, 0, 0);
        atomic_fetch_sub(&sleepers, 1);
        spin_until = seconds() + 200e-6;
      }
    }
    seen = atomic_load(&posted);
    unsigned helped = run_chunks((unsigned)(atomic_load(&claim) >> 32));
    if (helped) __atomic_fetch_add(&mlx_ring_sgemm_rows_helped, helped, __ATOMIC_RELAXED);
  }
  return 0;
}

static void forget_helpers(void) { /* a forked child has none of them */
  helpers_up = 0;
  atomic_store(&sleepers, 0);
  atomic_flag_clear(&busy);
}

static void start_helpers(void) {
  for (int i = helpers_up + 1; i < threads; i++) {
    pthread_t thread;
    if (pthread_create(&thread, 0, helper, 0) != 0) break;
    pthread_detach(thread);
    helpers_up = i;
  }
}

static void rows_product(rows_kernel kernel, int m, int n, int k, float alpha, const float *a,
                         int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  /* one product at a time uses the helpers; a second caller thread computes alone */
  if (threads < 2 || n < 2 * MIN_CHUNK || atomic_flag_test_and_set(&busy)) {
    kernel(m, 0, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  start_helpers();
  /* whole panels of two vectors (panel_rows), so only the last chunk has a scalar tail */
  int per_chunk = (n / (threads * CHUNKS_PER_THREAD) + 2 * LANES) & ~(2 * LANES - 1);
  per_chunk = per_chunk < MIN_CHUNK ? MIN_CHUNK : per_chunk;
  job.kernel = kernel, job.m = m, job.n = n, job.k = k, job.alpha = alpha, job.beta = beta;
  job.a = a, job.lda = lda, job.b = b, job.ldb = ldb, job.c = c, job.ldc = ldc;
  job.per_chunk = per_chunk;
  unsigned chunks = (unsigned)((n + per_chunk - 1) / per_chunk);
  atomic_store(&done_chunks, 0);
  unsigned product = (unsigned)(atomic_load(&claim) >> 32) + 1;
  atomic_store(&claim, (unsigned long long)product << 32 | (unsigned long long)chunks << 16);
  atomic_fetch_add(&posted, 1);
  if (atomic_load(&sleepers) > 0)
    syscall(SYS_futex, &posted, FUTEX_WAKE_PRIVATE, MAX_THREADS, 0, 0, 0);
  run_chunks(product);
  for (int spins = 0; atomic_load(&done_chunks) != chunks; spins++)
    if (spins % 256 == 255) sched_yield(); /* a helper mid-chunk may need this core */
    else RELAX();
  atomic_flag_clear(&busy);
}

/* ---- the entry point MLX calls ------------------------------------------------------- */

__attribute__((constructor)) static void find_next(void) {
  atomic_store(&next_sgemm, (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm"));
  next_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
  int (*openblas_threads)(void) = (int (*)(void))dlsym(RTLD_NEXT, "openblas_get_num_threads");
  threads = openblas_threads ? openblas_threads() : 1;
  threads = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
  pthread_atfork(0, 0, forget_helpers);
}

/* the cblas_sgemm after this library: found at load, else now; none stops the process */
static sgemm_fn sgemm_after(void) {
  sgemm_fn next = atomic_load(&next_sgemm);
  if (next != 0) return next;
  next = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
  if (next == 0) {
    static const char message[] =
        "native/sgemm_rows.c: no cblas_sgemm after this library in the process, so this "
        "product cannot be computed; preload OpenBLAS after it (launcher/cpu_layer.py does) "
        "or set NATIVE_KERNELS=off\n";
    ssize_t written = write(2, message, sizeof message - 1);
    (void)written;
    abort();
  }
  atomic_store(&next_sgemm, next);
  return next;
}

/* y = alpha * x op(B) + beta * y for one row x (stride incx), op(B) being k x n */
static void sgemv_row(int trans_b, int n, int k, float alpha, const float *x, int incx,
                      const float *b, int ldb, float beta, float *y) {
  if (trans_b == NO_TRANS) /* B is k x n: y = B^T x */
    next_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, x, incx, beta, y, 1);
  else /* B is n x k: y = B x */
    next_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, x, incx, beta, y, 1);
}

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc) {
  if (order == COL_MAJOR) { /* the same product as the row-major C^T = op(B)^T op(A)^T */
    cblas_sgemm(ROW_MAJOR, trans_b, trans_a, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
    return;
  }
  int a_plain = trans_a == NO_TRANS;
  if (order != ROW_MAJOR || k <= 0 || n <= 0 || m <= 0 || m > ROWS) {
    sgemm_after()(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  if (a_plain && trans_b != NO_TRANS) {
    rows_product(dot_rows, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else if (a_plain && m > 1 && n >= PANEL_COLUMNS) { /* B is [k, n], wide: the head */
    rows_product(panel_rows, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else if (a_plain && m > 1) { /* B is [k, n], narrow: attention's weights @ values */
    sgemm_after()(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  } else if (m <= SGEMV_ROWS && next_sgemv != 0) { /* a row of op(A): contiguous when plain */
    for (int i = 0; i < m; i++) {
      const float *x = a_plain ? a + (long)i * lda : a + i;
      sgemv_row(trans_b, n, k, alpha, x, a_plain ? 1 : lda, b, ldb, beta, c + (long)i * ldc);
    }
  } else {
    sgemm_after()(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  __atomic_fetch_add(&mlx_ring_sgemm_rows_calls, 1, __ATOMIC_RELAXED);
}
