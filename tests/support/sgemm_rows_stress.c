/* Many threads through native/sgemm_rows.c at once, each product checked against a
   plain loop (tests/test_sgemm_rows_threads.py builds and runs it, also under
   ThreadSanitizer).

   usage: sgemm_rows_stress CALLERS PRODUCTS [OPENBLAS_THREADS]

   CALLERS threads each compute PRODUCTS products of random shapes: mostly a few rows
   against a weight stored [out, in] (the library's own kernel, whose columns its helper
   threads share with one caller at a time while the other callers compute alone), some
   against [in, out] (one OpenBLAS sgemv a row) and some of too many rows (on to OpenBLAS's
   sgemm). Every 16th product a caller sleeps 1 ms first, so the helpers go from spinning
   to sleeping and are woken again. Prints the worst error, the products the library took
   over and the chunks its helper threads computed; exits 1 where a product was wrong. The
   library's helpers are as many as OpenBLAS's threads (OPENBLAS_NUM_THREADS) when it loads;
   OPENBLAS_THREADS then sets OpenBLAS's own pool alone (1: OpenBLAS computes on the thread
   that calls it). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n, int k, float alpha,
                 const float *a, int lda, const float *b, int ldb, float beta, float *c,
                 int ldc);
void openblas_set_num_threads(int threads);
extern unsigned long mlx_ring_sgemm_rows_calls, mlx_ring_sgemm_rows_helped;

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, MAX_M = 24, MAX_N = 700, MAX_K = 96 };

static int products;

static unsigned next_random(unsigned *state) {
  *state = *state * 1103515245u + 12345u;
  return *state >> 8;
}

static float uniform(unsigned *state) { return (float)(next_random(state) % 2001) / 1000.f - 1.f; }

static void *caller(void *arg) {
  unsigned state = (unsigned)(uintptr_t)arg * 7919u + 1u;
  float *a = malloc(sizeof(float) * MAX_M * MAX_K), *b = malloc(sizeof(float) * MAX_N * MAX_K);
  float *c = malloc(sizeof(float) * MAX_M * MAX_N), *want = malloc(sizeof(float) * MAX_M * MAX_N);
  double *worst = malloc(sizeof(double));
  *worst = 0;
  for (int p = 0; p < products; p++) {
    unsigned kind = next_random(&state) % 8; /* 0: [in, out]; 1: too many rows; else ours */
    int m = kind == 1 ? 17 + (int)(next_random(&state) % 8) : 1 + (int)(next_random(&state) % 16);
    m = kind == 0 && m > 4 ? 1 + m % 4 : m;
    int n = 1 + (int)(next_random(&state) % MAX_N), k = 1 + (int)(next_random(&state) % MAX_K);
    int trans_b = kind == 0 ? NO_TRANS : TRANS;
    float alpha = 0.5f, beta = next_random(&state) % 2 ? 2.f : 0.f;
    for (int i = 0; i < m * k; i++) a[i] = uniform(&state);
    for (int i = 0; i < n * k; i++) b[i] = uniform(&state);
    for (int i = 0; i < m * n; i++) c[i] = uniform(&state);
    for (int i = 0; i < m; i++)
      for (int j = 0; j < n; j++) {
        double dot = 0;
        for (int t = 0; t < k; t++)
          dot += (double)a[i * k + t] * (trans_b == TRANS ? b[j * k + t] : b[t * n + j]);
        want[i * n + j] = (float)(alpha * dot + beta * c[i * n + j]);
      }
    if (p % 16 == 15) nanosleep(&(struct timespec){0, 1000000}, 0);
    cblas_sgemm(ROW_MAJOR, NO_TRANS, trans_b, m, n, k, alpha, a, k, b,
                trans_b == TRANS ? k : n, beta, c, n);
    for (int i = 0; i < m * n; i++) {
      double error = fabs((double)c[i] - (double)want[i]);
      *worst = error > *worst || isnan(error) ? (isnan(error) ? INFINITY : error) : *worst;
    }
  }
  free(a), free(b), free(c), free(want);
  return worst;
}

int main(int argc, char **argv) {
  if (argc != 3 && argc != 4) {
    fprintf(stderr, "usage: %s CALLERS PRODUCTS [OPENBLAS_THREADS]\n", argv[0]);
    return 2;
  }
  if (argc == 4) openblas_set_num_threads(atoi(argv[3])); /* the library counted its own */
  int callers = atoi(argv[1]);
  products = atoi(argv[2]);
  pthread_t threads[64];
  callers = callers < 1 ? 1 : callers > 64 ? 64 : callers;
  for (int i = 0; i < callers; i++) pthread_create(&threads[i], 0, caller, (void *)(uintptr_t)i);
  double worst = 0;
  for (int i = 0; i < callers; i++) {
    double *mine;
    pthread_join(threads[i], (void **)&mine);
    worst = *mine > worst ? *mine : worst;
    free(mine);
  }
  unsigned long taken = __atomic_load_n(&mlx_ring_sgemm_rows_calls, __ATOMIC_RELAXED);
  unsigned long helped = __atomic_load_n(&mlx_ring_sgemm_rows_helped, __ATOMIC_RELAXED);
  printf("{\"worst\": %g, \"products\": %d, \"taken_over\": %lu, \"helped\": %lu}\n", worst,
         callers * products, taken, helped);
  return worst < 1e-3 ? 0 : 1;
}
