// Weight-only int8 linear for the few rows of a decode step on CPU:
//   y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]      x fp32 [M, K], q int8 [N, K]
// Exact int8 -> fp32 conversion and fp32 accumulation: the fallback's arithmetic
// ((x @ Q.T) * scale), in another summation order.
//
// Batch-1 decode streams every weight from memory once per token, so what counts is the
// bandwidth this loop sustains. A tile is 4 adjacent weight rows (contiguous: 4K bytes)
// against up to 4 rows of x, 16 fp32 accumulators in AVX-512 registers; each 16 weights are
// converted once (vpmovsxbd, vcvtdq2ps) and used by every x row. Each cache line of the tile
// prefetches the same line of the next tile, one tile ahead: without it, the hardware
// prefetcher left this loop at ~14 GB/s on SmolLM2's weights (~135 MB, far past the
// caches), with it ~19 GB/s, where aten::_weight_int8pack_mm (bfloat16 activations, the
// cast included) sustains ~12 GB/s here. Tiles are split across threads by at::parallel_for.
//
// Without AVX-512 a plain loop stands in (the compiler vectorizes what it can).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTileRows = 4;  // weight rows (outputs) per tile

#ifdef __AVX512F__
// Rows [n0, n0 + nr) of y for x rows [m0, m0 + MB).
template <int MB>
inline void tile(const float* x, const int8_t* q, const float* scale, float* y, int64_t K,
                 int64_t N, int64_t n0, int64_t nr, int64_t m0) {
  __m512 acc[MB][kTileRows];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kTileRows; ++r) acc[i][r] = _mm512_setzero_ps();
  const int8_t* row[kTileRows];
  for (int r = 0; r < kTileRows; ++r) row[r] = q + (n0 + std::min<int64_t>(r, nr - 1)) * K;
  const int64_t ahead = kTileRows * K;  // the same line of the next tile
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    if ((k & 63) == 0)
      for (int r = 0; r < kTileRows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(row[r] + k + ahead), _MM_HINT_T0);
    __m512 w[kTileRows];
    for (int r = 0; r < kTileRows; ++r)
      w[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[r] + k))));
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
      for (int r = 0; r < kTileRows; ++r) acc[i][r] = _mm512_fmadd_ps(w[r], xv, acc[i][r]);
    }
  }
  if (k < K) {  // K not a multiple of 16: masked loads
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 w[kTileRows];
    for (int r = 0; r < kTileRows; ++r)
      w[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, row[r] + k)));
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + (m0 + i) * K + k);
      for (int r = 0; r < kTileRows; ++r) acc[i][r] = _mm512_fmadd_ps(w[r], xv, acc[i][r]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < nr; ++r)
      y[(m0 + i) * N + n0 + r] = _mm512_reduce_add_ps(acc[i][r]) * scale[n0 + r];
}
#endif

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat &&
                  x.is_contiguous(),
              "int8_linear: x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() &&
                  q.size(1) == x.size(1),
              "int8_linear: q must be a contiguous int8 [N, K] tensor with x's K");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous() && scales.size(0) == q.size(0),
              "int8_linear: scales must be a contiguous float32 [N] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows, nr = std::min<int64_t>(kTileRows, N - n0);
#ifdef __AVX512F__
      int64_t m0 = 0;
      for (; m0 + 4 <= M; m0 += 4) tile<4>(xp, qp, sp, yp, K, N, n0, nr, m0);
      switch (M - m0) {
        case 3: tile<3>(xp, qp, sp, yp, K, N, n0, nr, m0); break;
        case 2: tile<2>(xp, qp, sp, yp, K, N, n0, nr, m0); break;
        case 1: tile<1>(xp, qp, sp, yp, K, N, n0, nr, m0); break;
        default: break;
      }
#else
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n0 + nr; ++n) {
          const int8_t* row = qp + n * K;
          const float* xr = xp + m * K;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < K; ++k) acc += static_cast<float>(row[k]) * xr[k];
          yp[m * N + n] = acc * sp[n];
        }
#endif
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("int8_linear", &int8_linear); }
