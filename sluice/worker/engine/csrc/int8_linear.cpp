// Weight-only int8 linear on CPU:
//   y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]      x fp32 [M, K], q int8 [N, K]
//
// Fewer than kGemmMinRows rows (decode steps): exact int8 -> fp32 conversion and fp32
// accumulation, the fallback's arithmetic ((x @ Q.T) * scale) in another summation order.
// Batch-1 decode streams every weight from memory once per token, so what counts is the
// bandwidth this loop sustains, and one core sustains far more reading one sequential
// stream than several interleaved ones. So q comes packed in tiles of 4 weight rows
// (``quant.pack_tiles``): [N / 4][K / 16][4][16], each 16-column chunk of the 4 rows
// contiguous, a tile one contiguous run read front to back. A tile's 4 rows meet up to 4
// rows of x in 16 fp32 accumulators in AVX-512 registers; each 16 weights are converted
// once (vpmovsxbd, vcvtdq2ps) and used by every x row; a software prefetch runs 512 bytes
// ahead. Over SmolLM2's 121 weight matrices (~135 MB, past every cache), one thread: 6.3 ms
// a step (21 GB/s), where the same loop over row-major q, 4 rows interleaved, took 13.8 ms
// and aten::_weight_int8pack_mm ~20 ms. Tiles are split across threads by at::parallel_for.
// Without AVX-512 a plain loop over the same layout stands in (the compiler vectorizes
// what it can).
//
// More rows (prefill chunks, large decode batches) are compute-bound, and there integers
// win: two_digit_gemm rounds each row of x to two int8 digits (~16 bits, as the 4-bit
// kernel does per block) and multiplies in int8 through at::_int_mm (oneDNN's VNNI GEMM,
// ~4x the fp32 matmul's rate on this CPU; two digits, two passes). 2 threads, SmolLM2's
// shapes: 1.3-2.3x faster than the fp32 matmul of the same rows from 64 rows up (3072x576
// at 256 rows: 4.4 vs 6.4 ms). One digit (per-row W8A8) cost SmolLM2 +4.4 % perplexity;
// two digits changed nothing measurable (22.362, the decode kernel's 22.363; bench/quant.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "row_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTileRows = 4;  // weight rows per tile
constexpr int64_t kChunk = 16;    // columns per chunk of a tile
constexpr int64_t kPrefetch = 512;  // bytes ahead in the tile's stream
// Rows from which two_digit_gemm runs instead of the tile loop: they cross near 48 rows
// (2 threads, SmolLM2's shapes: 48 rows 0.61 vs 0.53 ms for 1536x576, 1.06 vs 0.86 for 3072x576).
constexpr int64_t kGemmMinRows = 48;

#ifdef __AVX512F__
// y[m0 .. m0 + MB)[n0 .. n0 + 4) from the tile at q (4 * K bytes).
template <int MB>
inline void tile(const float* x, const int8_t* q, const float* scale, float* y, int64_t K,
                 int64_t N, int64_t n0, int64_t m0) {
  __m512 acc[MB][kTileRows];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kTileRows; ++r) acc[i][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kChunk) {
    const int8_t* chunk = q + k * kTileRows;
    _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetch), _MM_HINT_T0);
    __m512 w[kTileRows];
    for (int r = 0; r < kTileRows; ++r)
      w[r] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + r * kChunk))));
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
      for (int r = 0; r < kTileRows; ++r) acc[i][r] = _mm512_fmadd_ps(w[r], xv, acc[i][r]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kTileRows; ++r)
      y[(m0 + i) * N + n0 + r] = _mm512_reduce_add_ps(acc[i][r]) * scale[n0 + r];
}
#endif

// y = x @ q.T * scale for many rows, in integers through at::_int_mm (oneDNN, VNNI): each
// row of x is rounded to two int8 digits, x[m] / dx[m] = d1 + d2 / 256 with dx[m] =
// max_k |x[m, k]| / 127 (~16 bits, as the 4-bit kernel's blocks), the two digit matrices
// go through one int8 GEMM as [2M, K], and y = (acc1 + acc2 / 256) * dx * scale.
at::Tensor two_digit_gemm(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1), N = scales.numel();
  at::Tensor rows = at::empty({N, K}, q.options());  // the tiles unpacked, row-major [N, K]
  const int8_t* qp = q.data_ptr<int8_t>();
  int8_t* rp = rows.data_ptr<int8_t>();
  at::parallel_for(0, N / kTileRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r = 0; r < kTileRows; ++r)
        for (int64_t k = 0; k < K; k += kChunk)
          std::memcpy(rp + (t * kTileRows + r) * K + k, qp + (t * K + k) * kTileRows + r * kChunk,
                      kChunk);
  });
  at::Tensor digits = at::empty({2 * M, K}, x.options().dtype(at::kChar));
  std::vector<float> dx(M);
  const float* xp = x.data_ptr<float>();
  int8_t* dp = digits.data_ptr<int8_t>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = xp + m * K;
      float amax = 0.f;
#pragma omp simd reduction(max : amax)
      for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::abs(xr[k]));
      dx[m] = amax / 127.f;
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* hi = dp + m * K;
      int8_t* lo = dp + (M + m) * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) {
        const float u = xr[k] * inv;
        const float d1 = std::nearbyint(u);
        hi[k] = static_cast<int8_t>(d1);
        lo[k] = static_cast<int8_t>(std::min(127.f, std::nearbyint((u - d1) * 256.f)));
      }
    }
  });
  const at::Tensor acc = at::_int_mm(digits, rows.t());  // [2M, N] int32
  at::Tensor y = at::empty({M, N}, x.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const int32_t* a1 = ap + m * N;
      const int32_t* a2 = ap + (M + m) * N;
      float* yr = yp + m * N;
      const float d = dx[m];
#pragma omp simd
      for (int64_t n = 0; n < N; ++n)
        yr[n] = (static_cast<float>(a1[n]) + static_cast<float>(a2[n]) * (1.f / 256.f)) * d *
                sp[n];
    }
  });
  return y;
}

}  // namespace

namespace sluice {

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat &&
                  x.is_contiguous(),
              "int8_linear: x must be a contiguous 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = scales.numel();
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kChar && q.is_contiguous() &&
                  q.size(0) * kTileRows == N && q.size(1) * kChunk == K &&
                  q.size(2) == kTileRows && q.size(3) == kChunk,
              "int8_linear: q must be int8 packed in tiles [N / 4, K / 16, 4, 16] (N = scales' "
              "length, K = x's columns)");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "int8_linear: scales must be a contiguous float32 [N] tensor");
  if (M >= kGemmMinRows) return two_digit_gemm(x, q, scales);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N / kTileRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows;
      const int8_t* qt = qp + t * kTileRows * K;
#ifdef __AVX512F__
      for_row_blocks(M, [&](auto mb, int64_t m0) {
        tile<decltype(mb)::value>(xp, qt, sp, yp, K, N, n0, m0);
      });
#else
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < kTileRows; ++r) {
          const float* xr = xp + m * K;
          float acc = 0.f;
          for (int64_t k = 0; k < K; k += kChunk) {
            const int8_t* chunk = qt + k * kTileRows + r * kChunk;
#pragma omp simd reduction(+ : acc)
            for (int64_t j = 0; j < kChunk; ++j) acc += static_cast<float>(chunk[j]) * xr[k + j];
          }
          yp[m * N + n0 + r] = acc * sp[n0 + r];
        }
#endif
    }
  });
  return y;
}

}  // namespace sluice

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("int8_linear", &sluice::int8_linear); }
