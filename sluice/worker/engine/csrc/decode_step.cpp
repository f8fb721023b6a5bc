// A decode step through every decoder layer of a Llama-family model in one call, for models
// whose layer linears all run the weight kernels (``--quantization int4`` or ``int8`` on
// CPU): the ops models/llama.py's DecoderLayer.forward runs for a batch of decode tokens (one
// per sequence), the same ops on the same tensors in the same order, then the final norm.
// So it gives the same result to the bit, and saves the ~270 module calls and ~1,400 op
// dispatches a Python step of SmolLM2's 30 layers makes: batch-1 ITL on 2 threads, int4
// 8.2 -> 6.0 ms, int8 9.0 -> 7.0 ms (medians, alternating rounds in one process).
//
//   decode_layers(x, cos, sin, weights, k_caches, v_caches, slot_mapping, block_tables,
//                 context_lens, heads, kv_heads, head_dim, eps, scale) -> hidden [T, H]
//   x [T, H]: the T decode tokens' embeddings, used as the residual stream (overwritten);
//   cos, sin [T, head_dim]: their rotary tables; per layer k_caches[l], v_caches[l]
//   [num_blocks, block_size, kv_heads, head_dim], this step's K/V written at slot_mapping
//   [T]; block_tables [T, max_blocks] and context_lens [T] as paged_decode's.
//   weights: per layer 14 entries, input_layernorm.weight; qkv_proj (w, scales, bias);
//   o_proj (w, scales, bias); post_attention_layernorm.weight; gate_up_proj (w, scales,
//   bias); down_proj (w, scales, bias); then the final norm's weight. A linear's w is 4-bit
//   (uint8 [N / 4, K / 32, 80], scales None) or int8 (int8 [N / 4, K / 16, 4, 16], scales
//   fp32 [N]), packed as quant.py packs them; bias None or [N].

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr size_t kLayerEntries = 14;

using Weights = std::vector<std::optional<at::Tensor>>;

// The linear whose (w, scales, bias) start at weights[i], applied to x [T, K].
at::Tensor linear(const Weights& weights, size_t i, const at::Tensor& x) {
  const at::Tensor& w = weights[i].value();
  at::Tensor y = w.scalar_type() == at::kByte
                     ? sluice::int4_linear(x.contiguous(), w, w.size(0) * 4)
                     : sluice::int8_linear(x.contiguous(), w, weights[i + 1].value());
  if (weights[i + 2]) y.add_(*weights[i + 2]);
  return y;
}

// This step's K and V rows of qkv [T, C] (at k_off and k_off + kv_size of each row) written
// to their cache slots (slot_mapping [T]); what index_copy_ writes, without its dispatch.
void write_kv(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
              const int64_t* slots, int64_t k_off, int64_t kv_size) {
  const int64_t T = qkv.size(0), C = qkv.stride(0);
  const float* src = qkv.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(kc + slots[t] * kv_size, src + t * C + k_off, kv_size * sizeof(float));
    std::memcpy(vc + slots[t] * kv_size, src + t * C + k_off + kv_size, kv_size * sizeof(float));
  }
}

}  // namespace

namespace sluice {

at::Tensor decode_layers(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                         const c10::List<std::optional<at::Tensor>>& weight_list,
                         at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& context_lens, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, double eps, double scale) {
  const Weights weights(weight_list.begin(), weight_list.end());
  const size_t layers = k_caches.size();
  TORCH_CHECK(layers > 0 && v_caches.size() == layers &&
                  weights.size() == kLayerEntries * layers + 1,
              "decode_layers: 14 weights per layer (one K and one V cache each) and the final "
              "norm's");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "decode_layers: x must be a contiguous [T, H] float32 tensor");
  const int64_t T = x.size(0), H = x.size(1);
  const int64_t q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == T,
              "decode_layers: slot_mapping must be a contiguous int64 [T] tensor");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (size_t l = 0; l < layers; ++l)
    TORCH_CHECK(k_caches[l].is_contiguous() && v_caches[l].is_contiguous() &&
                    k_caches[l].scalar_type() == at::kFloat &&
                    v_caches[l].scalar_type() == at::kFloat &&
                    k_caches[l].numel() % kv_size == 0 && v_caches[l].numel() == k_caches[l].numel(),
                "decode_layers: caches must be contiguous float32 [blocks, block_size, kv_heads, "
                "head_dim]");
  const int64_t cache_slots = k_caches[0].numel() / kv_size;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < cache_slots, "decode_layers: slot ", slots[t],
                " is outside the cache's ", cache_slots, " slots");
  at::Tensor residual = x, hidden;
  for (size_t l = 0; l < layers; ++l) {
    const size_t w = l * kLayerEntries;
    if (l == 0)
      hidden = at::rms_norm(residual, {H}, weights[w].value(), eps);
    else
      add_rms_norm_(hidden, residual, weights[w].value(), eps);
    const at::Tensor qkv = linear(weights, w + 1, hidden);
    rotary_(qkv, cos, sin, heads + kv_heads, head_dim);  // q and k side by side
    write_kv(qkv, k_caches[l], v_caches[l], slots, q_size, kv_size);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({T, heads, head_dim});
    const at::Tensor o =
        paged_decode(q, k_caches[l], v_caches[l], block_tables, context_lens, scale);
    hidden = linear(weights, w + 4, o.reshape({T, q_size}));
    add_rms_norm_(hidden, residual, weights[w + 7].value(), eps);
    hidden = linear(weights, w + 11, silu_and_mul(linear(weights, w + 8, hidden)));
  }
  add_rms_norm_(hidden, residual, weights.back().value(), eps);
  return hidden;
}

}  // namespace sluice

TORCH_LIBRARY_FRAGMENT(sluice, m) {
  m.def("decode_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor?[] weights, "
        "Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor slot_mapping, Tensor block_tables, "
        "Tensor context_lens, int heads, int kv_heads, int head_dim, float eps, float scale) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("decode_layers", &sluice::decode_layers); }
