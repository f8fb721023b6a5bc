// Weight-only 4-bit linear for the few rows of a decode step on CPU, llama.cpp's Q4_1 format:
// each row of W [N, K] in blocks of 32 weights, each block a scale d and a minimum m
// (float16) and 32 unsigned 4-bit values q:
//   W[n, 32 b + j] = d[n, b] * q[n, 32 b + j] + m[n, b]          q in [0, 15]
//   y[m, n] = sum_b (d[n, b] * sum_j q x + m[n, b] * sum_j x)    over the block's columns
// Dequantization is one fp32 fma (q, d and m are exact in fp32); accumulation is in fp32.
//
// Layout (``quant.pack_int4``): like int8_linear's tiles of 4 weight rows, one contiguous run
// per tile, read front to back: [N / 4][K / 32][80] bytes, each 32-column block of the 4 rows
// 64 bytes of nibbles (row r's 16 bytes at 16 r; byte j holds q[j] in its low nibble and
// q[j + 16] in its high one, as GGML stores Q4_1) then 16 bytes of (d, m) float16 pairs, row
// by row. 0.625 bytes a weight, int8's 1 plus its scale: batch-1 decode streams every weight
// once per token, so the step reads ~40 % fewer bytes.
//
// Without AVX-512 a plain loop over the same layout stands in.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "row_blocks.h"

#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTileRows = 4;                     // weight rows per tile
constexpr int64_t kBlock = 32;                       // weights per (d, m) block
constexpr int64_t kNibbleBytes = kTileRows * 16;     // 4 rows x 32 nibbles
constexpr int64_t kBlockBytes = kNibbleBytes + kTileRows * 4;  // + 4 (d, m) float16 pairs
constexpr int64_t kPrefetch = 640;                   // bytes ahead in the tile's stream

inline void scale_and_min(const uint8_t* block, int64_t r, float* d, float* m) {
  uint16_t h[2];
  std::memcpy(h, block + kNibbleBytes + 4 * r, 4);
  *d = static_cast<float>(c10::Half(h[0], c10::Half::from_bits()));
  *m = static_cast<float>(c10::Half(h[1], c10::Half::from_bits()));
}

#ifdef __AVX512F__
// y[m0 .. m0 + MB)[n0 .. n0 + 4) from the tile at w ((K / 32) * 80 bytes).
template <int MB>
inline void tile(const float* x, const uint8_t* w, float* y, int64_t K, int64_t N, int64_t n0,
                 int64_t m0) {
  __m512 acc[MB][kTileRows];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kTileRows; ++r) acc[i][r] = _mm512_setzero_ps();
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t k = 0; k < K; k += kBlock) {
    const uint8_t* block = w + (k / kBlock) * kBlockBytes;
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetch), _MM_HINT_T0);
    __m512 xlo[MB], xhi[MB];
    for (int i = 0; i < MB; ++i) {
      xlo[i] = _mm512_loadu_ps(x + (m0 + i) * K + k);
      xhi[i] = _mm512_loadu_ps(x + (m0 + i) * K + k + 16);
    }
    for (int r = 0; r < kTileRows; ++r) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * r));
      float d, m;
      scale_and_min(block, r, &d, &m);
      const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
      const __m512 wlo = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low))), dv, mv);
      const __m512 whi = _mm512_fmadd_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low))),
          dv, mv);
      for (int i = 0; i < MB; ++i)
        acc[i][r] = _mm512_fmadd_ps(whi, xhi[i], _mm512_fmadd_ps(wlo, xlo[i], acc[i][r]));
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < kTileRows; ++r) y[(m0 + i) * N + n0 + r] = _mm512_reduce_add_ps(acc[i][r]);
}
#endif

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, int64_t N) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat &&
                  x.is_contiguous(),
              "int4_linear: x must be a contiguous 2-D float32 CPU tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.size(0) * kTileRows == N && w.size(1) * kBlock == K &&
                  w.size(2) == kBlockBytes,
              "int4_linear: w must be uint8 packed in tiles [N / 4, K / 32, 80] (K = x's "
              "columns)");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tile_bytes = (K / kBlock) * kBlockBytes;
  at::parallel_for(0, N / kTileRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows;
      const uint8_t* wt = wp + t * tile_bytes;
#ifdef __AVX512F__
      for_row_blocks(M, [&](auto mb, int64_t m0) {
        tile<decltype(mb)::value>(xp, wt, yp, K, N, n0, m0);
      });
#else
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < kTileRows; ++r) {
          const float* xr = xp + m * K;
          float acc = 0.f;
          for (int64_t k = 0; k < K; k += kBlock) {
            const uint8_t* block = wt + (k / kBlock) * kBlockBytes;
            float d, mn;
            scale_and_min(block, r, &d, &mn);
            for (int64_t j = 0; j < 16; ++j) {
              const uint8_t b = block[16 * r + j];
              acc += (d * static_cast<float>(b & 0x0F) + mn) * xr[k + j] +
                     (d * static_cast<float>(b >> 4) + mn) * xr[k + j + 16];
            }
          }
          yp[m * N + n0 + r] = acc;
        }
#endif
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("int4_linear(Tensor x, Tensor w, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("int4_linear", &int4_linear); }
