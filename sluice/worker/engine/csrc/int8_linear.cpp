// Weight-only int8 linear on CPU:
//   y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]      x fp32 [M, K], q int8 [N, K]
//
// Each row of x is first rounded to two int8 digits, x[m] / dx[m] = d1 + d2 / 256 with
// dx[m] = max_k |x[m, k]| / 127 (~16 bits, as the 4-bit kernel's blocks), and the rest is
// exact integer arithmetic: y = (a1 + a2 / 256) * dx * scale with a_i = sum_k d_i q. One
// digit (per-row W8A8) cost SmolLM2 +4.4 % perplexity; two changed nothing measurable
// (22.362 against the 22.363 of an fp32-accumulating kernel that kept x exact;
// bench/quant.py). Both paths below compute the same integers and the same epilogue, so a
// row's output does not depend on the batch it came in (batch-invariant, to the bit).
//
// Fewer than kGemmMinRows rows (decode steps): tile_loop. Batch-1 decode streams every
// weight from memory once per token, so what counts is the bandwidth this loop sustains,
// and one core sustains far more reading one sequential stream than several interleaved
// ones. So q comes packed in tiles of 4 weight rows (``quant.pack_tiles``): [N / 4][K /
// 16][4][16], each 16-column chunk of the 4 rows contiguous, a tile one contiguous run read
// front to back, split across threads by at::parallel_for. With AVX-512 VNNI one vpdpbusd
// multiplies a 64-byte chunk by 16 digits of x and sums each 4 products into a 32-bit lane
// (about 3x fewer instructions a weight than converting weights to fp32 for FMAs); without
// it a plain integer loop gives the same integers.
//
// More rows (prefill chunks, large decode batches) are compute-bound: two_digit_gemm runs
// the two digit matrices as one [2M, K] int8 GEMM through at::_int_mm (oneDNN's VNNI GEMM,
// ~4x the fp32 matmul's rate on this CPU). 2 threads, SmolLM2's shapes: 1.3-2.3x faster
// than the fp32 matmul of the same rows from 64 rows up (3072x576 at 256 rows: 4.4 vs 6.4 ms).

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
// Bytes ahead in the tile's stream that each chunk prefetches. Batch-1 int8 ITL on a
// 20 GB/s host, in one process, rounds alternating: 512 bytes 10.3 ms, 2048 8.1, 4096 7.5,
// 8192 and 16384 no better than 4096 (a stream needs this many bytes in flight to reach
// the bandwidth; the hardware prefetcher alone falls short).
constexpr int64_t kPrefetch = 4096;
// Rows from which two_digit_gemm runs instead of the tile loop: they cross near 48 rows
// (2 threads, SmolLM2's shapes, tile loop vs GEMM: 32 rows 0.52 vs 0.64 ms for 3072x576,
// 0.33 vs 0.46 for 576x1536; 48 rows 0.77 vs 0.75 and 0.50 vs 0.33).
constexpr int64_t kGemmMinRows = 48;

// Row m of x [M, K] rounded to two int8 digits: x[m] = dx[m] * (hi + lo / 256), dx[m] =
// max_k |x[m, k]| / 127. Both paths round x here, so they multiply the same integers. A
// row with a NaN gets dx NaN (the max skips a NaN), so its outputs are NaN, as F.linear's.
void round_rows(const float* xp, int64_t M, int64_t K, int8_t* hi, int8_t* lo, float* dx) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* xr = xp + m * K;
      float amax = 0.f, nan = 0.f;  // nan: 0, or NaN when the row holds a NaN or an inf
#pragma omp simd reduction(max : amax) reduction(+ : nan)
      for (int64_t k = 0; k < K; ++k) {
        amax = std::max(amax, std::abs(xr[k]));
        nan += xr[k] * 0.f;
      }
      dx[m] = amax / 127.f + nan;
      const float inv = amax > 0.f && nan == 0.f ? 127.f / amax : 0.f;
      int8_t* h = hi + m * K;
      int8_t* l = lo + m * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) {
        const float u = inv == 0.f ? 0.f : xr[k] * inv;  // (never a NaN to convert)
        const float d1 = std::nearbyint(u);
        h[k] = static_cast<int8_t>(d1);
        l[k] = static_cast<int8_t>(std::min(127.f, std::nearbyint((u - d1) * 256.f)));
      }
    }
  });
}

// y from the two digits' integer dot products a1, a2 (a2 / 256 is exact: fused or not, the
// same float).
inline float from_digits(int32_t a1, int32_t a2, float dx, float scale) {
  return (static_cast<float>(a1) + static_cast<float>(a2) * (1.f / 256.f)) * dx * scale;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// y[m0 .. m0 + MB)[n0 .. n0 + 4) from the tile at q (4 * K bytes). A 64-byte chunk holds 16
// columns of the 4 rows; vpdpbusd multiplies it by x's 16 digits broadcast to the 4 rows
// (as unsigned bytes, digit + 128, i.e. its sign bit flipped: vpdpbusd's left operand is
// unsigned) and adds each 4 products to one 32-bit lane, so lane 4r + j sums row r's
// columns 4j .. 4j + 3. 128 * sum(q) is taken back off at the end (the same vpdpbusd on
// bytes of 1 counts it). digits: [2][M][K], x's first digits then its second.
template <int MB>
inline void tile(const int8_t* digits, const int8_t* q, const float* scale, const float* dx,
                 float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t m0) {
  __m512i acc[MB][2];
  __m512i wsum = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi8(1);
  const __m128i sign = _mm_set1_epi8(static_cast<char>(0x80));
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += kChunk) {
    const int8_t* chunk = q + k * kTileRows;
    _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetch), _MM_HINT_T0);
    const __m512i w = _mm512_loadu_si512(chunk);
    wsum = _mm512_dpbusd_epi32(wsum, ones, w);
    for (int i = 0; i < MB; ++i)
      for (int d = 0; d < 2; ++d) {
        const __m512i xv = _mm512_broadcast_i32x4(_mm_xor_si128(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(digits + (d * M + m0 + i) * K + k)),
            sign));
        acc[i][d] = _mm512_dpbusd_epi32(acc[i][d], xv, w);
      }
  }
  const __m512i offset = _mm512_slli_epi32(wsum, 7);  // 128 * sum(q) per lane
  for (int i = 0; i < MB; ++i) {
    int32_t a[2][16];
    for (int d = 0; d < 2; ++d) {
      __m512i v = _mm512_sub_epi32(acc[i][d], offset);
      v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));
      v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_CDAB));  // each 128-bit lane: its row's sum
      _mm512_storeu_si512(a[d], v);
    }
    for (int r = 0; r < kTileRows; ++r)
      y[(m0 + i) * N + n0 + r] = from_digits(a[0][4 * r], a[1][4 * r], dx[m0 + i], scale[n0 + r]);
  }
}
#endif

// y = x @ q.T * scale for many rows through at::_int_mm (oneDNN, VNNI): the two digit
// matrices go through one int8 GEMM as [2M, K].
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
  int8_t* dp = digits.data_ptr<int8_t>();
  round_rows(x.data_ptr<float>(), M, K, dp, dp + M * K, dx.data());
  const at::Tensor acc = at::_int_mm(digits, rows.t());  // [2M, N] int32
  at::Tensor y = at::empty({M, N}, x.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
#pragma omp simd
      for (int64_t n = 0; n < N; ++n)
        yp[m * N + n] = from_digits(ap[m * N + n], ap[(M + m) * N + n], dx[m], sp[n]);
  });
  return y;
}

// The same y for few rows, streaming the tiles: x's digits [2][M][K] stay in L1 while every
// tile passes once.
at::Tensor tile_loop(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1), N = scales.numel();
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<int8_t> digits(2 * M * K);  // [2][M][K], as two_digit_gemm's
  std::vector<float> dx(M);
  round_rows(x.data_ptr<float>(), M, K, digits.data(), digits.data() + M * K, dx.data());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  at::parallel_for(0, N / kTileRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for_row_blocks(M, [&](auto mb, int64_t m0) {
        tile<decltype(mb)::value>(digits.data(), qp + t * kTileRows * K, sp, dx.data(), yp,
                                  M, K, N, t * kTileRows, m0);
      });
  });
#else  // the same integers, summed by a plain loop
  at::parallel_for(0, N / kTileRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < kTileRows; ++r) {
          int32_t a1 = 0, a2 = 0;
          for (int64_t k = 0; k < K; k += kChunk) {
            const int8_t* chunk = qp + t * kTileRows * K + k * kTileRows + r * kChunk;
            for (int64_t j = 0; j < kChunk; ++j) {
              a1 += int32_t{digits[m * K + k + j]} * chunk[j];
              a2 += int32_t{digits[(M + m) * K + k + j]} * chunk[j];
            }
          }
          yp[m * N + t * kTileRows + r] = from_digits(a1, a2, dx[m], sp[t * kTileRows + r]);
        }
  });
#endif
  return y;
}

}  // namespace

namespace sluice {

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat &&
                  x.is_contiguous(),
              "int8_linear: x must be a contiguous 2-D float32 CPU tensor");
  const int64_t K = x.size(1), N = scales.numel();
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kChar && q.is_contiguous() &&
                  q.size(0) * kTileRows == N && q.size(1) * kChunk == K &&
                  q.size(2) == kTileRows && q.size(3) == kChunk,
              "int8_linear: q must be int8 packed in tiles [N / 4, K / 16, 4, 16] (N = scales' "
              "length, K = x's columns)");
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "int8_linear: scales must be a contiguous float32 [N] tensor");
  return x.size(0) >= kGemmMinRows ? two_digit_gemm(x, q, scales) : tile_loop(x, q, scales);
}

}  // namespace sluice

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("int8_linear", &sluice::int8_linear); }
