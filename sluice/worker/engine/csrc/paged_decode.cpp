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
//
// Vectorisation is left to the compiler (-O3 -march=native, -fopenmp for `omp simd`):
// the dot product's reduction and the axpy are marked `#pragma omp simd`.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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
  TORCH_CHECK(k_cache.size(3) == D && heads_q % heads_kv == 0, "paged_decode: head shapes do not match");
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
