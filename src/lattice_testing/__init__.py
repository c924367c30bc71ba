"""Fixtures built locally for tests, benchmarks and demonstrations; nothing here is used by the library itself.

* `lattice_testing.toy`: tiny random-weight causal LMs of several architectures and a byte-level
  tokenizer (``python -m lattice_testing.toy DIR`` writes one to a directory).
* `lattice_testing.mtp_checkpoint`: tiny random Qwen3-Next / Qwen3.5 checkpoints holding an MTP head.
"""
