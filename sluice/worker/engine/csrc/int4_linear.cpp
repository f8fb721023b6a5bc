// Weight-only 4-bit linear on CPU, llama.cpp's Q4_1 format, for the few rows of a decode step
// (tile()) and for prefill chunks and large batches (group(), from kGroupMinRows rows):
// each row of W [N, K] in blocks of 32 weights, each block a scale d and a minimum m
// (float16) and 32 unsigned 4-bit values q:
//   W[n, 32 b + j] = d[n, b] * q[n, 32 b + j] + m[n, b]          q in [0, 15]
//
// The rows of x are quantized too, once per call, in blocks of 32 as llama.cpp's Q8_1 (its
// vec_dot_q4_1_q8_1 is the scheme), with a second int8 digit: x / dx = xq + xr / 256 for
// dx = max|x| / 127, xq = round(x / dx), xr = round(256 (x / dx - xq)), both in [-127, 127],
// and the block's sum s = dx * sum_j (xq + xr / 256). Then, per block, the integer dot
// products are exact and
//   y[m, n] = sum_b (d[n, b] * dx[m, b] / 256 * sum_j q (256 xq + xr) + m[n, b] * s[m, b])
// which is x' @ W.T for x' = dx * (xq + xr / 256), x to ~16 bits a block (|x - x'| <=
// dx / 512), accumulated in fp32. One digit alone (Q8_1) cost SmolLM2 0.9 % perplexity on
// bench/quant.py's text; the second costs two more vpdpbusd a block.
//
// Layout (``quant.pack_int4``): like int8_linear's tiles of 4 weight rows, one contiguous run
// per tile, read front to back: [N / 4][K / 32][80] bytes, each 32-column block of the 4 rows
// 64 bytes of nibbles (row r's 16 bytes at 16 r; byte j holds q[j] in its low nibble and
// q[j + 16] in its high one, as GGML stores Q4_1) then 16 bytes of (d, m) float16 pairs, row
// by row. 0.625 bytes a weight, int8's 1 plus its scale: batch-1 decode streams every weight
// once per token, so the step reads ~40 % fewer bytes.
//
// With AVX-512 VNNI a block of the 4 rows is one 64-byte load: its low and high nibbles
// against the x block's two halves (each broadcast to the 4 rows) are two vpdpbusd (u8 x s8
// into int32 lanes, lanes 4 r .. 4 r + 3 row r's, then summed: the block's whole dot product)
// per digit, then one fp32 fma by d * dx and one by m * s. Without it a plain loop over the same layout stands in, with the same
// arithmetic.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"
#include "row_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define SLUICE_INT4_VNNI 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTileRows = 4;                     // weight rows per tile
constexpr int64_t kBlock = 32;                       // weights per (d, m) block
constexpr int64_t kNibbleBytes = kTileRows * 16;     // 4 rows x 32 nibbles
constexpr int64_t kBlockBytes = kNibbleBytes + kTileRows * 4;  // + 4 (d, m) float16 pairs
constexpr int64_t kPrefetch = 50 * kBlockBytes;      // bytes ahead in the stream: int8_linear's
constexpr int64_t kGroupMinRows = 8;  // x rows from which group() beats tile() (below)

// x [M, K] in blocks of 32, two int8 digits each: q and r [M, K], d and s [M, K / 32].
struct Q8Rows {
  std::vector<int8_t> q, r;
  std::vector<float> d, s;
};

// 1 / d, or 0 (the block rounds to zeros) when d is 0 or so small that 1 / d overflows: a
// block whose largest |x| is below ~3e-37 (it made every digit garbage).
inline float scale_inverse(float d) {
  const float inv = d > 0.f ? 1.f / d : 0.f;
  return std::isfinite(inv) ? inv : 0.f;
}

Q8Rows quantize_rows(const float* x, int64_t M, int64_t K) {
  Q8Rows out{std::vector<int8_t>(M * K), std::vector<int8_t>(M * K),
             std::vector<float>(M * K / kBlock), std::vector<float>(M * K / kBlock)};
  // blocks split across threads: single-threaded, a long prefill chunk's rounding was an
  // estimated ~10 % of its matmul's time
  at::parallel_for(0, M * K / kBlock, 256, [&](int64_t begin, int64_t end) {
#ifdef SLUICE_INT4_VNNI
    // The same arithmetic 16 values at a time (a prefill chunk's rounding was ~40 % of this
    // kernel's time at 512 rows in the scalar loop below).
    for (int64_t b = begin; b < end; ++b) {
      const float* xb = x + b * kBlock;
      const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
      const float amax =
          _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const bool nan = _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) |
                       _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q);
      const float d = nan ? NAN : amax / 127.f, inv = scale_inverse(d);
      __m512i sum = _mm512_setzero_si512();
      for (int h = 0; h < 2; ++h) {
        const __m512 v = _mm512_mul_ps(h ? x1 : x0, _mm512_set1_ps(inv));
        const __m512 q = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        // (max_ps gives its second operand for a NaN, as std::max(-127.f, NaN) gives -127)
        const __m512 r = _mm512_min_ps(_mm512_max_ps(
            _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(v, q), _mm512_set1_ps(256.f)),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
            _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
        const __m512i qi = _mm512_cvtps_epi32(q), ri = _mm512_cvtps_epi32(r);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + b * kBlock + 16 * h),
                         _mm512_cvtepi32_epi8(qi));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out.r.data() + b * kBlock + 16 * h),
                         _mm512_cvtepi32_epi8(ri));
        sum = _mm512_add_epi32(sum, _mm512_add_epi32(_mm512_slli_epi32(qi, 8), ri));
      }
      out.d[b] = d / 256.f;
      out.s[b] = out.d[b] * static_cast<float>(_mm512_reduce_add_epi32(sum));
    }
#else
    for (int64_t b = begin; b < end; ++b) {
      const float* xb = x + b * kBlock;
      float amax = 0.f;
      bool nan = false;
      for (int64_t j = 0; j < kBlock; ++j) {
        amax = std::max(amax, std::fabs(xb[j]));
        nan |= std::isnan(xb[j]);
      }
      const float d = nan ? NAN : amax / 127.f, inv = scale_inverse(d);
      int32_t sum = 0;
      for (int64_t j = 0; j < kBlock; ++j) {
        const float v = inv == 0.f ? 0.f : xb[j] * inv;  // (never a NaN to convert)
        const float q = std::nearbyint(v);
        const float r = std::min(127.f, std::max(-127.f, std::nearbyint((v - q) * 256.f)));
        out.q[b * kBlock + j] = static_cast<int8_t>(q);
        out.r[b * kBlock + j] = static_cast<int8_t>(r);
        sum += 256 * static_cast<int32_t>(q) + static_cast<int32_t>(r);
      }
      out.d[b] = d / 256.f;  // the scale of the two digits together: 256 q + r
      out.s[b] = out.d[b] * static_cast<float>(sum);
    }
#endif
  });
  return out;
}

inline void scale_and_min(const uint8_t* block, int64_t r, float* d, float* m) {
  uint16_t h[2];
  std::memcpy(h, block + kNibbleBytes + 4 * r, 4);
  *d = static_cast<float>(c10::Half(h[0], c10::Half::from_bits()));
  *m = static_cast<float>(c10::Half(h[1], c10::Half::from_bits()));
}

#ifdef SLUICE_INT4_VNNI
// The 4 rows' nibbles (low: columns 0-15 of each row, high: 16-31) against one int8 digit of
// an x block (32 values, each half broadcast to the 4 rows): lanes 4 r .. 4 r + 3 row r's.
inline __m512i dot_block(__m512i qlo, __m512i qhi, const int8_t* x) {
  const __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  const __m512i xhi =
      _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16)));
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qlo, xlo), qhi, xhi);
}

// y[m0 .. m0 + MB)[n0 .. n0 + 4) from the tile at w ((K / 32) * 80 bytes).
template <int MB>
inline void tile(const Q8Rows& x, const uint8_t* w, float* y, int64_t K, int64_t N, int64_t n0,
                 int64_t m0) {
  const int64_t blocks = K / kBlock;
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  // (d0 m0 d1 m1 d2 m2 d3 m3) -> each row's d (or m) in its 4 lanes
  const __m512i d_lanes = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
  const __m512i m_lanes = _mm512_set_epi32(7, 7, 7, 7, 5, 5, 5, 5, 3, 3, 3, 3, 1, 1, 1, 1);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = w + b * kBlockBytes;
    _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetch), _MM_HINT_T0);
    const __m512i nibbles = _mm512_loadu_si512(block);
    const __m512i qlo = _mm512_and_si512(nibbles, low);
    const __m512i qhi = _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low);
    const __m512 dm = _mm512_castps256_ps512(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kNibbleBytes))));
    const __m512 dv = _mm512_permutexvar_ps(d_lanes, dm);
    const __m512 mv = _mm512_permutexvar_ps(m_lanes, dm);
    for (int i = 0; i < MB; ++i) {
      const int64_t xb = (m0 + i) * blocks + b;
      const __m512i dq = dot_block(qlo, qhi, x.q.data() + xb * kBlock);
      const __m512i dr = dot_block(qlo, qhi, x.r.data() + xb * kBlock);
      __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dq, 8), dr);
      // each row's 4 lanes summed, into all 4: the block's whole dot product, exact (< 2^24:
      // in fp32 too), as group() has it, so the fp32 arithmetic below is group()'s
      dot = _mm512_add_epi32(dot, _mm512_shuffle_epi32(dot, _MM_PERM_CDAB));
      dot = _mm512_add_epi32(dot, _mm512_shuffle_epi32(dot, _MM_PERM_BADC));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, _mm512_set1_ps(x.d[xb])),
                               _mm512_fmadd_ps(mv, _mm512_set1_ps(x.s[xb]), acc[i]));
    }
  }
  for (int i = 0; i < MB; ++i) {
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, acc[i]);
    for (int r = 0; r < kTileRows; ++r) y[(m0 + i) * N + n0 + r] = lanes[4 * r];
  }
}

// The many-row path (prefill chunks, large decode batches). tile() above broadcasts each x
// block to 4 weight rows and sums each row's 4 lanes: fine for a few rows, where the weight
// stream is the cost, but slow where the arithmetic is. Here 16 weight rows are unpacked once
// (``unpack_group``) into vpdpbusd's own layout, each 32-bit lane one weight row and its 4
// bytes 4 consecutive columns, against up to 4 x rows a block: each x row's 4 columns are one
// broadcast load, a vpdpbusd 16 rows x 4 columns, 8 of them a block's dot product per digit.
// Bit-identical to tile(): both take each block's whole integer dot product (exact, < 2^24:
// in fp32 too) and then the same fp32 fma pair, so an output row does not depend on how many
// rows came in one call. (With one fp32 accumulator per quarter of a block's columns, as
// tile() had before group() existed, group() took 1.35-1.5x this time from 16 rows, in one
// process alternating; batch 1 was the same either way.)
constexpr int64_t kGroupRows = 4 * kTileRows;  // weight rows per group: 4 tiles
constexpr int64_t kGroupBlockBytes = 8 * 64;   // a block unpacked: 8 column quads x 16 rows

// 16 rows' blocks (4 tiles from w, tile_bytes apart) into q [blocks][8][16 rows][4 columns]
// (nibble values; quad c is columns 4 c .. 4 c + 3) and d, m [blocks][16] fp32.
inline void unpack_group(const uint8_t* w, int64_t tile_bytes, int64_t blocks, uint8_t* q,
                         float* d, float* m) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i lo[4], hi[4];  // a tile's columns 0-15 and 16-31: lane 4 r + c row r's quad c
    for (int t = 0; t < 4; ++t) {
      const uint8_t* block = w + t * tile_bytes + b * kBlockBytes;
      const __m512i nibbles = _mm512_loadu_si512(block);
      lo[t] = _mm512_and_si512(nibbles, low);
      hi[t] = _mm512_and_si512(_mm512_srli_epi16(nibbles, 4), low);
      for (int r = 0; r < kTileRows; ++r)
        scale_and_min(block, r, d + b * kGroupRows + 4 * t + r, m + b * kGroupRows + 4 * t + r);
    }
    uint8_t* out = q + b * kGroupBlockBytes;
    for (int c = 0; c < 4; ++c) {  // lane 4 t + r <- lane 4 r + c of tile t's vector
      const __m512i first = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 28 + c, 24 + c, 20 + c,
                                             16 + c, 12 + c, 8 + c, 4 + c, c);
      const __m512i second = _mm512_set_epi32(28 + c, 24 + c, 20 + c, 16 + c, 12 + c, 8 + c,
                                              4 + c, c, 0, 0, 0, 0, 0, 0, 0, 0);
      _mm512_storeu_si512(out + 64 * c, _mm512_mask_blend_epi32(
          0xFF00, _mm512_permutex2var_epi32(lo[0], first, lo[1]),
          _mm512_permutex2var_epi32(lo[2], second, lo[3])));
      _mm512_storeu_si512(out + 64 * (4 + c), _mm512_mask_blend_epi32(
          0xFF00, _mm512_permutex2var_epi32(hi[0], first, hi[1]),
          _mm512_permutex2var_epi32(hi[2], second, hi[3])));
    }
  }
}

inline __m512i x_quad(const int8_t* x) {  // (a broadcast load: vpdpbusd's port stays free)
  return _mm512_broadcastd_epi32(_mm_loadu_si32(x));
}

// y[m0 .. m0 + MB)[n0 .. n0 + 16) from one unpacked group. The 2 MB integer dot products of
// a block (x rows x digits) are interleaved column quad by column quad: 2 MB independent
// vpdpbusd chains rather than one 8-deep chain (latency-bound) after another.
template <int MB>
inline void group(const Q8Rows& x, const uint8_t* q, const float* d, const float* m, float* y,
                  int64_t K, int64_t N, int64_t n0, int64_t m0) {
  const int64_t blocks = K / kBlock;
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* wb = q + b * kGroupBlockBytes;
    const int8_t *xq[MB], *xr[MB];
    __m512i dq[MB], dr[MB];
    for (int i = 0; i < MB; ++i) {
      xq[i] = x.q.data() + ((m0 + i) * blocks + b) * kBlock;
      xr[i] = x.r.data() + ((m0 + i) * blocks + b) * kBlock;
      dq[i] = dr[i] = _mm512_setzero_si512();
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const __m512i w = _mm512_loadu_si512(wb + 64 * c);
      for (int i = 0; i < MB; ++i) {
        dq[i] = _mm512_dpbusd_epi32(dq[i], w, x_quad(xq[i] + 4 * c));
        dr[i] = _mm512_dpbusd_epi32(dr[i], w, x_quad(xr[i] + 4 * c));
      }
    }
    const __m512 dv = _mm512_loadu_ps(d + b * kGroupRows);
    const __m512 mv = _mm512_loadu_ps(m + b * kGroupRows);
    for (int i = 0; i < MB; ++i) {
      const int64_t xb = (m0 + i) * blocks + b;
      const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(dq[i], 8), dr[i]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dv, _mm512_set1_ps(x.d[xb])),
                               _mm512_fmadd_ps(mv, _mm512_set1_ps(x.s[xb]), acc[i]));
    }
  }
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(y + (m0 + i) * N + n0, acc[i]);
}
#endif

}  // namespace

namespace sluice {

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
  const Q8Rows xq = quantize_rows(x.data_ptr<float>(), M, K);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = K / kBlock, tile_bytes = blocks * kBlockBytes;
#ifdef SLUICE_INT4_VNNI
  if (M >= kGroupMinRows && N % kGroupRows == 0) {
    at::parallel_for(0, N / kGroupRows, 1, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> q(blocks * kGroupBlockBytes);
      std::vector<float> d(blocks * kGroupRows), m(blocks * kGroupRows);
      for (int64_t g = begin; g < end; ++g) {
        unpack_group(wp + g * (kGroupRows / kTileRows) * tile_bytes, tile_bytes, blocks,
                     q.data(), d.data(), m.data());
        for_row_blocks(M, [&](auto mb, int64_t m0) {
          group<decltype(mb)::value>(xq, q.data(), d.data(), m.data(), yp, K, N,
                                     g * kGroupRows, m0);
        });
      }
    });
    return y;
  }
#endif
  at::parallel_for(0, N / kTileRows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileRows;
      const uint8_t* wt = wp + t * tile_bytes;
#ifdef SLUICE_INT4_VNNI
      for_row_blocks(M, [&](auto mb, int64_t m0) {
        tile<decltype(mb)::value>(xq, wt, yp, K, N, n0, m0);
      });
#else
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < kTileRows; ++r) {
          float acc = 0.f;
          for (int64_t b = 0; b < blocks; ++b) {
            const uint8_t* block = wt + b * kBlockBytes;
            const int8_t* xb = xq.q.data() + (m * blocks + b) * kBlock;
            const int8_t* rb = xq.r.data() + (m * blocks + b) * kBlock;
            int32_t dot = 0;
            for (int64_t j = 0; j < 16; ++j) {
              const uint8_t v = block[16 * r + j];
              dot += (v & 0x0F) * (256 * xb[j] + rb[j]) + (v >> 4) * (256 * xb[j + 16] + rb[j + 16]);
            }
            float d, mn;
            scale_and_min(block, r, &d, &mn);
            acc += d * xq.d[m * blocks + b] * static_cast<float>(dot) + mn * xq.s[m * blocks + b];
          }
          yp[m * N + n0 + r] = acc;
        }
#endif
    }
  });
  return y;
}

}  // namespace sluice

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("int4_linear(Tensor x, Tensor w, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("int4_linear", &sluice::int4_linear); }
