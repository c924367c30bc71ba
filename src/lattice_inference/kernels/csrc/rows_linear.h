// Float32 (and, where no bfloat16 dot products run, bfloat16) linear layers whose every row is computed the same
// way at any width (AVX512F or AVX2+FMA): see rows_linear.cpp.
#pragma once
#include <torch/extension.h>

// The vector instructions `rows_linear` runs on in this build: "avx512", "avx2", or "" (neither: oneDNN's instead).
std::string rows_linear_kernel();
// A dense float32 or bfloat16 weight [out, in] (out a multiple of 16) laid out for `rows_linear`: [out / 16, in,
// 16], each input's 16 outputs of a block side by side (one 64- or 32-byte vector).
torch::Tensor rows_pack(const torch::Tensor& weight);
// x [..., in] (the weight's dtype) @ weight.T + bias over a `rows_pack`ed weight: each output of each row one
// float32 sum taking the inputs in order (one fused multiply-add each), the bias added last, rounded to the dtype.
torch::Tensor rows_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias);
// Whether ``packed`` is in `rows_pack`'s layout.
inline bool rows_packed(const torch::Tensor& packed) {
  return packed.dim() == 3 && packed.size(2) == 16 &&
         (packed.scalar_type() == torch::kFloat32 || packed.scalar_type() == torch::kBFloat16);
}
