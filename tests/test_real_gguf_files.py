"""The Q4_K_M files people download, run as stored: Qwen2.5-Coder-0.5B and 1.5B (Qwen2) and Gemma-3-270M.

Every matrix of each file is computed from its blocks (Q4_K, Q5_0, Q6_K, Q8_0: none dequantized), the embedding
stays in its blocks, the output layer keeps no dense copy, the chat template comes from the file's metadata, and
prompt lookup (greedy and seeded) and batches equal plain decoding of it token for token. Each module skips with a
one-line reason where the file's packages are not installed (`lattice_testing.real_files`).
"""

from __future__ import annotations

import pytest

from lattice_inference import Generator
from lattice_inference.benchmark import GROUNDED_TASKS, encode_prompt, load_prompts
from lattice_inference.kernels import native_ops
from lattice_inference.models.gguf_quantized import QuantizedEmbedding, quantized_weights
from lattice_inference.models.load import load_model
from lattice_inference.targets.exactness import check_exactness
from lattice_testing.real_files import missing, real_file

from .helpers import assert_same_tokenizer

if native_ops.quant() is None:
    pytest.skip("our quantized products do not run here", allow_module_level=True)

EXPECTED = {
    "qwen2.5-coder-0.5b": ({"Q4_K": 12, "Q5_0": 132, "Q6_K": 12, "Q8_0": 13}, "Q5_0"),
    "gemma-3-270m": ({"Q4_K": 27, "Q5_0": 81, "Q6_K": 9, "Q8_0": 10}, "Q8_0"),
    "qwen2.5-coder-1.5b": ({"Q4_K": 168, "Q6_K": 29}, "Q4_K"),
}
"""Per file: the linear layers computed per format (the embedding's blocks are looked up, counted apart), and the
embedding's format."""


@pytest.fixture(scope="module", params=list(EXPECTED))
def loaded(request):
    path = real_file(request.param)
    if path is None:
        pytest.skip(missing(request.param))
    return request.param, load_model(str(path), dtype="auto")


def test_every_matrix_is_computed_from_its_blocks(loaded):
    short, result = loaded
    done = quantized_weights(result.model)
    native, embedding_kind = EXPECTED[short]
    assert done is not None and dict(done.native) == native and not done.dequantized
    embedding = result.model.get_input_embeddings()
    assert isinstance(embedding, QuantizedEmbedding) and embedding.kind == embedding_kind
    assert result.model.get_output_embeddings().weight.device.type == "meta"  # no dense copy of the vocabulary
    if short.startswith("qwen"):
        assert result.tokenizer.chat_template and "<|im_start|>" in result.tokenizer.chat_template


def test_prompt_lookup_and_batches_equal_plain_decoding(loaded):
    short, result = loaded
    prompts = [p for p in load_prompts(GROUNDED_TASKS) if p.set == "grounded"][1::7][:2]
    budget = 24 if short.endswith("1.5b") else 48
    eos = result.eos_token_ids
    plain = Generator(result.model, result.tokenizer, method="greedy", eos_token_ids=eos)
    ngram = Generator(result.model, result.tokenizer, method="ngram", eos_token_ids=eos, target=plain.decoder.target)
    if short.startswith("gemma"):  # the base model's file has no chat template: its conversations as plain text
        texts = [plain.encode("\n\n".join(m["content"] for m in p.messages or [])) for p in prompts]
    else:
        texts = [encode_prompt(plain, p) for p in prompts]
    for text in texts:
        want = plain.generate(text, budget)
        got = ngram.generate(text, budget)
        assert got.token_ids == want.token_ids and got.metrics.exact is not False
        seeded = plain.generate(text, budget, temperature=0.8, seed=4).token_ids
        assert ngram.generate(text, budget, temperature=0.8, seed=4).token_ids == seeded
    report = check_exactness(plain.decoder.target, 8)  # trees too: Gemma's sliding windows cut by position
    assert report.exact and report.trees and report.batched, report.failures
    alone = [ngram.generate(t, 16).token_ids for t in texts]
    assert [r.token_ids for r in ngram.generate_many(texts, 16, max_batch=2)] == alone


def test_the_tokenizer_is_the_files_own(loaded, tmp_path, monkeypatch):
    """The tokenizer read from the cache (one pass of its ``tokenizer.json``) is transformers' tokenizer of the file:
    the same ids, texts, special tokens and chat template (Gemma's 262k vocabulary included)."""
    from transformers import AutoTokenizer

    short, result = loaded
    path = real_file(short)
    assert_same_tokenizer(result.tokenizer, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))
