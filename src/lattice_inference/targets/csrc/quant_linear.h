// Linear layers over GGUF-quantized weights (Q8_0, Q4_0, Q4_1) kept in their blocks: see quant_linear.cpp.
#pragma once
#include <string>
#include <torch/extension.h>

// The vector instructions `quant_linear` runs on in this build: "avx512_vnni", "avx512", "avx2", or "" (neither:
// quantized weights are dequantized at load instead).
std::string quant_linear_kernel();
// x [..., in] (float32) @ weight.T + bias over a GGUF-quantized weight in `quant_pack`'s layout (uint8 [out / 16,
// in / 32, superblock]: Q8_0 544, Q4_0 288, Q4_1 320 bytes). Each row's inputs are quantized to 8 bits per block of
// 32 (as llama.cpp's Q8_0 activations), each block's integer dot products are exact, and each output sums its
// blocks' scaled dots in input order: every row the same at any width, and the same in every build.
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias);
// Whether ``packed`` is in `quant_pack`'s layout (its last size names the format).
inline bool quant_packed(const torch::Tensor& packed) {
  return packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 &&
         (packed.size(2) == 544 || packed.size(2) == 288 || packed.size(2) == 320);
}
