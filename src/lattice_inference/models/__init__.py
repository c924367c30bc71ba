"""Where a model comes from and how it loads: the one home for naming a model, reading its files and building it.

- `source`: what a ``--model`` argument names (a Hugging Face folder, a GGUF file, the ``smollm2`` default, the
  bundled hybrid, a hub id), resolved without loading anything.
- `load`: `load_model`, the entry point: the dtype chosen for the device, the checks a user can act on, the model
  and its tokenizer (`LoadedModel`).
- `gguf_index`: a GGUF file's header and tensors, read without building its metadata values.
- `gguf_dequantized`: a GGUF file dequantized through transformers, cached as a Hugging Face folder.
- `gguf_quantized`: a GGUF file run as stored, its quantized blocks attached to the model's linear layers.
- `hybrid_families`: the Gated DeltaNet hybrid families (Qwen3-Next, Qwen3.5) by ``model_type``.
- `cache`: where what is made once per machine is kept.

Nothing here imports at package import, so `targets` may take `cache` without loading the rest.
"""
