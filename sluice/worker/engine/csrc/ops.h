// The CPU ops of the sluice_kernels library, callable from each other's files as well as
// registered as torch.ops.sluice.* (each file's top comment says what its op computes).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace sluice {

// paged_decode.cpp
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale);
// int8_linear.cpp, int4_linear.cpp
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& w, int64_t N);
// decode_ops.cpp
void add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& x);
void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
             int64_t head_dim);
at::Tensor argmax_rows(const at::Tensor& x);

}  // namespace sluice
