// Linear layers over one bfloat16 weight layout, on Intel AMX tiles or AVX512-BF16 dot products: see
// tile_linear.cpp.
#pragma once
#include <string>
#include <torch/extension.h>

// The kernel `tile_linear` runs in this process: "amx" (built with AMX, the OS grants the tiles, and AMX is
// preferred), "avx512_bf16" (built with AVX512-BF16), or "" (neither: the callers use oneDNN).
std::string tile_linear_kernel();
// Whether `tile_linear` runs here (`tile_linear_kernel` is not empty).
bool tile_linear_available();
// Whether to run AMX tiles where they are built and granted (the default), in the bfloat16 products (else the
// AVX512-BF16 kernel) and the quantized ones (else their vector kernel at every width): set once, before any product.
void prefer_amx(bool prefer);
// A dense bfloat16 weight [out, in] (out a multiple of 16, in of 32) laid out for `tile_linear`:
// [out / 16, in / 2, 16, 2], each block of 16 outputs holding pairs of inputs side by side (the tiles' B layout).
torch::Tensor tile_pack(const torch::Tensor& weight);
// x [..., in] (bfloat16) @ weight.T + bias, over a `tile_pack`ed weight; bfloat16 out, float32 sums.
torch::Tensor tile_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias);
// Whether ``packed`` is in `tile_pack`'s layout (else it is a oneDNN-packed weight).
inline bool tile_packed(const torch::Tensor& packed) {
  return packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2;
}
