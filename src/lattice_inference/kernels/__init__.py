"""The products and native ops every runner computes with, below both `targets` (which run models on them) and
`models` (which load GGUF weights into their layouts): `native_ops` (the C++ ops, built once per machine from
`csrc/`), `packed_linear` (linear layers packed for our kernels), `quant_linear` (GGUF blocks as our quantized
kernels read them) and `decode_matched` (each product's row plan: how it computes k rows exactly as k 1-row calls)."""
