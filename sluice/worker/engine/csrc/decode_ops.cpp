// The small fp32 ops between a decode layer's matmuls, each one call instead of several ATen
// ops (a batch-1 decode step of SmolLM2 made ~4,100 ATen calls, most of its time outside the
// matmuls). The same arithmetic as the PyTorch path they replace, elementwise; only a
// reduction's order (the RMS) differs. Rows are split across threads by at::parallel_for.
//
//   add_rms_norm_(x, residual, weight, eps): residual += x; x = weight * (residual *
//       rsqrt(mean(residual^2) + eps)): vLLM's fused_add_rms_norm (RMSNorm: Zhang &
//       Sennrich 2019), x and residual [T, H] updated in place.
//   silu_and_mul(x [T, 2I]) -> [T, I]: silu(x[:, :I]) * x[:, I:] (SwiGLU, Shazeer 2020);
//       silu(g) = g / (1 + exp(-g)) with exp16 (vec_exp.h, ~2 ulp) under AVX-512: 1,536
//       values in well under a microsecond, where at::silu and mul_ took ~8 us a call.
//   rotary_(x, cos, sin, heads, head_dim): the first heads * head_dim columns of x [T, C]
//       rotated in place, rotate-half layout (RoPE, Su et al. 2021): for each head,
//       x1' = x1 * cos1 - x2 * sin1 and x2' = x2 * cos2 + x1 * sin2, cos/sin [T, head_dim].
//   argmax_rows(x [N, V]) -> int64 [N]: each row's first index of its maximum, a NaN
//       counting as the maximum (torch.argmax's answer). The greedy token of every row of
//       a step's logits: at::argmax took ~100 us a row of 49,152 here (4 ms for 64 rows),
//       this ~11 us (0.34 ms).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "ops.h"
#include "vec_exp.h"

#include <cmath>

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.scalar_type() == at::kFloat &&
                  t.stride(1) == 1,
              name, " must be a 2-D float32 CPU tensor with contiguous rows");
}

// y[i] = silu(gate[i]) * up[i] for i < n.
inline void silu_mul_row(const float* gate, const float* up, float* y, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 e = sluice::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, e)),
                                          _mm512_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) y[i] = gate[i] / (1.f + std::exp(-gate[i])) * up[i];
}

// The first index of row x[0 .. n)'s maximum; of its first NaN if it has one.
int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best = 0;
  float top = n > 0 ? x[0] : 0.f;
#ifdef __AVX512F__
  if (n >= 16) {  // per lane: its maximum and the first index where it occurs
    __m512 vmax = _mm512_loadu_ps(x);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i idx = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(x + i);
      idx = _mm512_add_epi32(idx, step);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, idx);
    }
    if (nan) {  // rare: a scan for the first NaN
      for (int64_t j = 0; j < n; ++j)
        if (std::isnan(x[j])) return j;
    }
    alignas(64) float vals[16];
    alignas(64) int32_t ids[16];
    _mm512_store_ps(vals, vmax);
    _mm512_store_epi32(ids, vidx);
    top = vals[0];
    best = ids[0];
    for (int j = 1; j < 16; ++j)
      if (vals[j] > top || (vals[j] == top && ids[j] < best)) top = vals[j], best = ids[j];
  }
#endif
  for (; i < n; ++i) {  // the tail (all of a row under 16 values), none of it seen yet
    if (std::isnan(x[i])) return i;
    if (x[i] > top) top = x[i], best = i;
  }
  return best;
}

}  // namespace

namespace sluice {

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "argmax_rows: x");
  TORCH_CHECK(x.size(0) == 0 || x.size(1) > 0, "argmax_rows: rows must not be empty");
  const int64_t N = x.size(0), V = x.size(1), xs = x.stride(0);
  TORCH_CHECK(V < (int64_t{1} << 31), "argmax_rows: rows of at most 2^31 - 1 values");
  at::Tensor out = at::empty({N}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * xs, V);
  });
  return out;
}

void add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm_: x");
  check_rows(residual, "add_rms_norm_: residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && weight.dim() == 1 && weight.is_contiguous() &&
                  weight.scalar_type() == at::kFloat && weight.size(0) == x.size(1),
              "add_rms_norm_: x and residual must be [T, H] and weight [H]");
  const int64_t T = x.size(0), H = x.size(1);
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* xr = xp + t * xs;
      float* rr = rp + t * rs;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t h = 0; h < H; ++h) {
        const float v = rr[h] + xr[h];
        rr[h] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + e);
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) xr[h] = wp[h] * (rr[h] * inv);
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul: x");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: x must have an even number of columns");
  const int64_t T = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  at::Tensor y = at::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_mul_row(xp + t * xs, xp + t * xs + I, yp + t * I, I);
  });
  return y;
}

void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
             int64_t head_dim) {
  check_rows(x, "rotary_: x");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.numel() == x.size(0) * head_dim &&
                  sin.numel() == cos.numel(),
              "rotary_: cos and sin must be contiguous float32 [T, head_dim]");
  TORCH_CHECK(head_dim % 2 == 0 && heads * head_dim <= x.size(1),
              "rotary_: heads * head_dim must fit in x's columns, head_dim even");
  const int64_t T = x.size(0), xs = x.stride(0), half = head_dim / 2;
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * head_dim;
      const float* s = sp + t * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* x1 = xp + t * xs + h * head_dim;
        float* x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[half + i] + a * s[half + i];
        }
      }
    }
  });
}

}  // namespace sluice

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, int heads, int head_dim) -> ()");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) {
  m.impl("add_rms_norm_", &sluice::add_rms_norm_);
  m.impl("silu_and_mul", &sluice::silu_and_mul);
  m.impl("rotary_", &sluice::rotary_);
  m.impl("argmax_rows", &sluice::argmax_rows);
}
