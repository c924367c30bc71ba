// Linear layers over GGUF-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) kept in their blocks: see
// quant_linear.cpp.
#pragma once
#include <string>
#include <torch/extension.h>

// The vector instructions `quant_linear` runs on in this build: "avx512_vnni", "avx512", "avx2", or "" (neither:
// quantized weights are dequantized at load instead).
std::string quant_linear_kernel();
// "amx_int8" where products of the 32-input formats take their dots from AMX tiles from some rows on (Q8_0 from 5,
// the others from 32) in this process (built with AMX, granted, preferred: `prefer_amx`), else "".
// The same bits either way.
std::string quant_linear_tiles();
// x [..., in] (float32) @ weight.T + bias over a GGUF-quantized weight in `quant_pack`'s layout (uint8 [out / 16,
// in / 32 or in / 256, superblock]: bytes by format as `quant_inputs` lists). Each row's inputs are quantized to 8
// bits as llama.cpp quantizes them for the format (Q8_0 per 32; Q8_K per 256 for the K-quants), each block's integer
// dot products are exact, and each output sums its blocks' scaled dots in input order: every row the same at any
// width, and the same in every build.
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias);
// Several `quant_pack`ed weights of one input size side by side (a fused q/k/v or gate/up whose members have
// different formats): the inputs quantized once per kind of activation, each part's outputs after the last's.
torch::Tensor quant_linear_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                                 const c10::optional<torch::Tensor>& bias);
// `quant_linear.quant_pack`'s layout of a GGUF tensor's data (uint8 [out, bytes], ``kind`` "Q8_0", "Q4_K", ...), made in
// one pass: the same bytes as the Python reference.
torch::Tensor quant_pack_native(const torch::Tensor& raw, const std::string& kind);
// Rows ``ids`` (int64 [n]) of a `quant_pack`ed ``kind`` weight as float32 [n, in]: what the file's blocks dequantize
// to (`quant_linear.dequantize`), bit for bit.
torch::Tensor quant_rows(const torch::Tensor& packed, const torch::Tensor& ids, const std::string& kind);
// Every format the products take (`quant_linear.FORMATS` in Python): its name, the bytes of one GGUF block, the
// inputs of one block (32; 256 for the K-quants) and the bytes of one `quant_pack` superblock (16 outputs), which
// names the format in a packed tensor's last size.
struct PackedFormat {
  const char* name;
  int64_t block_bytes, inputs, packed_bytes;
};
inline constexpr PackedFormat PACKED_FORMATS[] = {
    {"Q8_0", 34, 32, 544},   {"Q4_0", 18, 32, 288},    {"Q4_1", 20, 32, 320},    {"Q5_0", 22, 32, 352},
    {"Q5_1", 24, 32, 384},   {"Q4_K", 144, 256, 2368}, {"Q5_K", 176, 256, 2880}, {"Q6_K", 210, 256, 3360},
};
// Inputs per superblock of a `quant_pack`ed format, by its superblock's bytes (its last size), else 0.
inline int64_t quant_inputs(int64_t bytes) {
  for (const PackedFormat& f : PACKED_FORMATS)
    if (f.packed_bytes == bytes) return f.inputs;
  return 0;
}
// Whether ``packed`` is in `quant_pack`'s layout (its last size names the format).
inline bool quant_packed(const torch::Tensor& packed) {
  return packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && quant_inputs(packed.size(2)) != 0;
}
