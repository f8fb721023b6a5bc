// Paged decode attention on CPU: each sequence's one query token attends over its K/V
// blocks where they lie in the block pool, with no gather and no padding mask.
//
// The algorithm is vLLM's paged attention v1 (K/V read through the block table, fp32
// accumulation) with FlashDecoding's online softmax: per block of keys, the running max m,
// the running sum l and the output accumulator of each query head are rescaled by
// exp(m_old - m_new), so K and V are read once. One work item (at::parallel_for) is one
// sequence with all its heads: a block's K (then V) rows [bs, H_kv, D] are read in memory
// order, each by the G = H_q / H_kv query heads that share its KV head (GQA). A work item
// per (sequence, KV head) read each block H_kv times in strides and ran ~1.7x slower at
// B = 64 here, where the pool does not fit in cache; at B = 1 it gave more parallelism.
// So the AVX-512 version below splits a sequence by KV head only when the batch is smaller
// than the thread count (batch-1 decode: every thread gets heads), each head's arithmetic
// the same either way.
//
// fp32 caches in blocks of 16 with heads of 64 or 128 (SmolLM2, Qwen2.5, Llama) take an
// AVX-512 version (paged_decode_fp32_avx512: scores a block at a time in one register,
// vectorized exp). Elsewhere vectorisation is left to the compiler (-O3 -march=native,
// -fopenmp for `omp simd`): the dot product's reduction and the axpy are `#pragma omp simd`.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "vec_exp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T>
inline void axpy(float a, const T* x, float* y, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += a * static_cast<float>(x[i]);
}

// q, out: [B, H_q, D]; k, v: [N, bs, H_kv, D]; tables: [B, max_blocks]; lens: [B]
template <typename T>
void paged_decode_kernel(const T* q, const T* k, const T* v, const int64_t* tables,
                         const int64_t* lens, T* out, int64_t batch, int64_t heads_q,
                         int64_t heads_kv, int64_t head_dim, int64_t block_size,
                         int64_t max_blocks, float scale) {
  const int64_t group = heads_q / heads_kv, D = head_dim, bs = block_size;
  const int64_t block_elems = bs * heads_kv * D;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    // per query head: the scaled query, the output accumulator, running max and sum, and
    // the scores of the current block
    std::vector<float> qf(heads_q * D), acc(heads_q * D), m(heads_q), l(heads_q), p(heads_q * bs);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ctx = lens[b];
      for (int64_t i = 0; i < heads_q * D; ++i) qf[i] = scale * static_cast<float>(q[b * heads_q * D + i]);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
        const int64_t n = std::min(bs, ctx - t0);
        const int64_t offset = tables[b * max_blocks + t0 / bs] * block_elems;
        const T* kb = k + offset;  // [bs, H_kv, D]
        const T* vb = v + offset;
        for (int64_t j = 0; j < n; ++j)  // K rows in memory order; query heads h*G.. read KV head h
          for (int64_t h = 0; h < heads_kv; ++h)
            for (int64_t hq = h * group; hq < (h + 1) * group; ++hq)
              p[hq * bs + j] = dot(qf.data() + hq * D, kb + (j * heads_kv + h) * D, D);
        for (int64_t hq = 0; hq < heads_q; ++hq) {
          float* s = p.data() + hq * bs;
          const float block_max = *std::max_element(s, s + n);
          if (block_max > m[hq]) {  // rescale what was accumulated under the old max
            const float c = std::exp(m[hq] - block_max);
            l[hq] *= c;
            for (int64_t i = 0; i < D; ++i) acc[hq * D + i] *= c;
            m[hq] = block_max;
          }
          for (int64_t j = 0; j < n; ++j) {
            s[j] = std::exp(s[j] - m[hq]);
            l[hq] += s[j];
          }
        }
        for (int64_t j = 0; j < n; ++j)
          for (int64_t h = 0; h < heads_kv; ++h)
            for (int64_t hq = h * group; hq < (h + 1) * group; ++hq)
              axpy(p[hq * bs + j], vb + (j * heads_kv + h) * D, acc.data() + hq * D, D);
      }
      for (int64_t hq = 0; hq < heads_q; ++hq)
        for (int64_t i = 0; i < D; ++i)
          out[(b * heads_q + hq) * D + i] = static_cast<T>(acc[hq * D + i] / l[hq]);
    }
  });
}

#ifdef __AVX512F__
// The same algorithm for fp32 caches in blocks of 16 tokens and heads of D = 16 C: a
// query head's C-register row and its C accumulators stay in AVX-512 registers while it
// runs over a block's keys (one dot product each), the block's 16 scores are one register
// (max, exp and sum in 16 lanes), then over the block's values. A block's K and V rows
// (16 x H_kv x D) stay in L1 while the G query heads of each KV head read them.
template <int C>
void paged_decode_fp32_avx512(const float* q, const float* k, const float* v,
                              const int64_t* tables, const int64_t* lens, float* out,
                              int64_t batch, int64_t heads_q, int64_t heads_kv,
                              int64_t max_blocks, float scale) {
  constexpr int64_t D = 16 * C, bs = 16;
  const int64_t group = heads_q / heads_kv, block_elems = bs * heads_kv * D;
  // work items per sequence: its KV heads one by one when there are fewer sequences than
  // threads, else the whole sequence
  const int64_t split = batch < at::get_num_threads() ? heads_kv : 1, span = heads_kv / split;
  at::parallel_for(0, batch * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(heads_q * D), m(heads_q), l(heads_q);
    alignas(64) float s[bs];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / split, h0 = item % split * span, h1 = h0 + span;
      const int64_t ctx = lens[b];
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t t0 = 0; t0 < ctx; t0 += bs) {
        const int64_t n = std::min(bs, ctx - t0);
        const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
        const int64_t offset = tables[b * max_blocks + t0 / bs] * block_elems;
        if (t0 + bs < ctx) {  // the next block lies elsewhere in the pool: fetch its rows meanwhile
          const int64_t next = tables[b * max_blocks + t0 / bs + 1] * block_elems;
          for (int64_t j = 0; j < bs; ++j)
            for (int64_t i = (j * heads_kv + h0) * D; i < (j * heads_kv + h1) * D; i += 16) {
              _mm_prefetch(reinterpret_cast<const char*>(k + next + i), _MM_HINT_T1);
              _mm_prefetch(reinterpret_cast<const char*>(v + next + i), _MM_HINT_T1);
            }
        }
        for (int64_t h = h0; h < h1; ++h) {
          const float* kb = k + offset + h * D;  // key j's row at kb + j * H_kv * D
          const float* vb = v + offset + h * D;
          for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
            __m512 qv[C], a[C];
            for (int c = 0; c < C; ++c)
              qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + (b * heads_q + hq) * D + 16 * c),
                                    _mm512_set1_ps(scale));
            for (int64_t j = 0; j < n; ++j) {
              const float* kr = kb + j * heads_kv * D;
              __m512 d = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
              for (int c = 1; c < C; ++c) d = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), d);
              s[j] = _mm512_reduce_add_ps(d);
            }
            const __m512 scores = _mm512_maskz_load_ps(live, s);
            const float block_max = _mm512_mask_reduce_max_ps(live, scores);
            float* accq = acc.data() + hq * D;
            for (int c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(accq + 16 * c);
            if (block_max > m[hq]) {  // rescale what was accumulated under the old max
              const float r = std::exp(m[hq] - block_max);
              l[hq] *= r;
              for (int c = 0; c < C; ++c) a[c] = _mm512_mul_ps(a[c], _mm512_set1_ps(r));
              m[hq] = block_max;
            }
            const __m512 e =
                _mm512_maskz_mov_ps(live, sluice::exp16(_mm512_sub_ps(scores, _mm512_set1_ps(m[hq]))));
            l[hq] += _mm512_reduce_add_ps(e);
            _mm512_store_ps(s, e);
            for (int64_t j = 0; j < n; ++j) {
              const float* vr = vb + j * heads_kv * D;
              const __m512 w = _mm512_set1_ps(s[j]);
              for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * c), a[c]);
            }
            for (int c = 0; c < C; ++c) _mm512_storeu_ps(accq + 16 * c, a[c]);
          }
        }
      }
      for (int64_t hq = h0 * group; hq < h1 * group; ++hq)
        for (int64_t i = 0; i < D; ++i) out[(b * heads_q + hq) * D + i] = acc[hq * D + i] / l[hq];
    }
  });
}
#endif

}  // namespace

namespace sluice {

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode: q [B, H_q, D], k_cache and v_cache [N, bs, H_kv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode: q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: caches must be contiguous");
  const int64_t batch = q.size(0), heads_q = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), heads_kv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && heads_kv > 0 && heads_q % heads_kv == 0,
              "paged_decode: head shapes do not match");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch && context_lens.numel() == batch,
              "paged_decode: block_tables [B, max_blocks] and context_lens [B]");
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).contiguous();
  const int64_t max_blocks = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {  // a bad table would read outside the pool
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_blocks * bs, "paged_decode: context length out of range");
    for (int64_t i = 0; i < (lp[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(tp[b * max_blocks + i] >= 0 && tp[b * max_blocks + i] < num_blocks,
                  "paged_decode: block id out of range");
  }
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
#ifdef __AVX512F__
  if (q.scalar_type() == at::kFloat && bs == 16 && (D == 64 || D == 128)) {
    auto kernel = D == 64 ? paged_decode_fp32_avx512<4> : paged_decode_fp32_avx512<8>;
    kernel(qc.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp, lp,
           out.data_ptr<float>(), batch, heads_q, heads_kv, max_blocks, static_cast<float>(scale));
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    paged_decode_kernel<scalar_t>(qc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                  v_cache.data_ptr<scalar_t>(), tp, lp, out.data_ptr<scalar_t>(),
                                  batch, heads_q, heads_kv, D, bs, max_blocks, static_cast<float>(scale));
  });
  return out;
}

}  // namespace sluice

TORCH_LIBRARY(sluice, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("paged_decode", &sluice::paged_decode); }
