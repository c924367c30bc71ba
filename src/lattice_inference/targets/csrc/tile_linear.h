// Linear layers on the CPU's matrix tiles (Intel AMX, bfloat16): see tile_linear.cpp.
#pragma once
#include <torch/extension.h>

// Whether this build and this process can run `tile_linear` (built with AMX, and the OS lets the process use it).
bool tile_linear_available();
// A dense bfloat16 weight [out, in] (out a multiple of 16, in of 32) laid out for `tile_linear`:
// [out / 16, in / 2, 16, 2], each block of 16 outputs holding pairs of inputs side by side (the tiles' B layout).
torch::Tensor tile_pack(const torch::Tensor& weight);
// x [..., in] (bfloat16) @ weight.T + bias, over a `tile_pack`ed weight; bfloat16 out, float32 sums.
torch::Tensor tile_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias);
// Whether ``packed`` is in `tile_pack`'s layout (else it is a oneDNN-packed weight).
inline bool tile_packed(const torch::Tensor& packed) {
  return packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2;
}
