/* The fp32 FMA roofline of this machine at one kernel tier: every OpenMP thread runs 12 independent
 * chains of fused multiply-adds on vectors as wide as the tier's (built with the tier's own -march,
 * bench/limits.py), for about half a second; prints the best of 5 rounds in GFLOP/s. */
#include <omp.h>
#include <stdio.h>

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));

int main(void) {
  const long iters = 40000000;
  double best = 0;
  for (int round = 0; round < 5; ++round) {
    const double start = omp_get_wtime();
    float sink = 0;
#pragma omp parallel reduction(+ : sink)
    {
      vf a[12];
      for (int i = 0; i < 12; ++i) a[i] = (vf){} + (float)i;
      const vf b = (vf){} + 0.9999999f, c = (vf){} + 1e-7f;
      for (long i = 0; i < iters; ++i)
        for (int j = 0; j < 12; ++j) a[j] = a[j] * b + c;
      for (int i = 0; i < 12; ++i) sink += a[i][0];
    }
    const double seconds = omp_get_wtime() - start;
    const double gflops = 2.0 * LANES * 12 * iters * omp_get_max_threads() / seconds / 1e9;
    if (gflops > best) best = gflops;
    if (sink == 12345.0f) printf(" ");
  }
  printf("%.1f\n", best);
  return 0;
}
