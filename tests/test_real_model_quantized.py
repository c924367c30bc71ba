"""The real default model as its file stores it: SmolLM2-135M-Instruct's Q4_1 GGUF with its weights kept quantized.

``--dtype auto`` keeps the file's Q4_1 (and its Q8_0 output/embedding) weights in their blocks on CPUs where our
quantized products run: every linear layer must be attached (none left dequantized) and the dense copies dropped;
plain decoding of it must stay close to the file dequantized to float32 (a different model: its inputs are
rounded to 8 bits per block, so tokens agree for a while and then may part); and prompt lookup, seeded sampling,
batches and the shipped MTP head must equal its own plain decoding. Skipped where the package or our quantized
products are absent.
"""

from __future__ import annotations

import pytest
import torch

from lattice_inference import Generator
from lattice_inference.api import mtp_head_for
from lattice_inference.benchmark import GROUNDED_TASKS, encode_prompt, load_prompts
from lattice_inference.devices import placement
from lattice_inference.kernels import native_ops
from lattice_inference.models.gguf_quantized import QuantizedEmbedding, quantized_weights
from lattice_inference.models.load import load_model
from lattice_inference.options import DecodeOptions

from .helpers import skip_without_real_model

skip_without_real_model()
if native_ops.quant() is None:
    pytest.skip("our quantized products do not run here", allow_module_level=True)

BUDGET = 40


@pytest.fixture(scope="module")
def quantized():
    return load_model("smollm2", dtype="auto")


def test_auto_keeps_every_linear_layer_of_the_file_quantized(quantized, capfd) -> None:
    done = quantized_weights(quantized.model)
    assert done is not None and dict(done.native) == {"Q4_1": 210, "Q8_0": 1} and not done.dequantized
    assert done.describe() == "linear layers computed as stored: 210 Q4_1, 1 Q8_0; dequantized to float32: none"
    assert placement(quantized.model) == {"device": "cpu", "dtype": "float32", "weights": "GGUF Q4_1+Q8_0"}
    layer = quantized.model.model.layers[0]
    assert layer.mlp.down_proj.weight.device.type == "meta"
    # the embedding stays in the file's Q8_0 blocks (looked up row by row) and the tied output layer computes from
    # them: no dense copy of either
    embedding = quantized.model.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding) and embedding.kind == "Q8_0"
    assert quantized.model.lm_head.weight.device.type == "meta" and embedding.weight.device.type == "meta"
    assert all(p.device.type in ("cpu", "meta") for p in quantized.model.parameters())
    assert load_model("smollm2", dtype="bfloat16").model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16


def test_speculation_equals_plain_decoding_of_the_quantized_model_which_stays_close_to_float32(
    quantized, smollm2_plain
) -> None:
    eos = quantized.eos_token_ids
    plain = Generator(quantized.model, quantized.tokenizer, method="greedy", eos_token_ids=eos)
    reference = smollm2_plain  # plain decoding of the file dequantized to float32 (conftest: shared references)
    ngram = Generator(quantized.model, quantized.tokenizer, method="ngram", adaptive=False, eos_token_ids=eos)
    assert plain.decoder.target.kv_cache == "float16"  # auto: a GGUF file as stored caches float16, as llama.cpp
    prompts = [p for p in load_prompts(GROUNDED_TASKS) if p.set == "grounded"][1::7][:5]
    ids = [encode_prompt(plain, p) for p in prompts]
    accepted = agreed = 0
    wanted = []
    for prompt in ids:
        want = plain.generate(prompt, max_new_tokens=BUDGET)
        wanted.append(want.token_ids)
        float32 = reference(prompt, BUDGET).token_ids
        agreed += next(
            (i for i, (a, b) in enumerate(zip(want.token_ids, float32, strict=False)) if a != b), len(float32)
        )
        fast = ngram.generate(prompt, max_new_tokens=BUDGET)
        assert fast.token_ids == want.token_ids
        accepted += fast.metrics.accepted_tokens
        seeded = plain.generate(prompt, max_new_tokens=24, temperature=0.8, seed=7).token_ids
        assert ngram.generate(prompt, max_new_tokens=24, temperature=0.8, seed=7).token_ids == seeded
    assert accepted > 0
    assert agreed >= len(ids) * 4  # the first tokens agree with the float32 model's (a broken layout agrees on none)
    many = ngram.generate_many(ids, BUDGET, max_batch=4)
    assert [r.token_ids for r in many] == wanted  # each prompt's plain decoding, above


def test_the_shipped_mtp_head_drafts_for_the_quantized_model_losslessly(quantized) -> None:
    eos = quantized.eos_token_ids
    head = mtp_head_for(quantized, DecodeOptions(method="mtp").draft_length)
    plain = Generator(quantized.model, quantized.tokenizer, method="greedy", eos_token_ids=eos)
    mtp = Generator(quantized.model, quantized.tokenizer, method="mtp", mtp_head=head, eos_token_ids=eos)
    prompt = encode_prompt(plain, load_prompts(GROUNDED_TASKS)[3])
    fast = mtp.generate(prompt, max_new_tokens=BUDGET)
    assert fast.token_ids == plain.generate(prompt, max_new_tokens=BUDGET).token_ids
    assert fast.metrics.drafted_tokens > 0
