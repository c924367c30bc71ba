"""lattice-inference: lossless speculative decoding for Hugging Face causal LMs."""
