"""Loading a GGUF file as stored without dequantizing it whole (`gguf_quantized.load_as_stored`) builds the same model
as dequantizing it to float32 and attaching the blocks by content (`gguf_dequantized.load_gguf` +
`gguf_quantized.attach`): the same blocks on the same layers in the same row order (llama's q/k rows permuted in the
file), the same dense tensors, the same tensors dropped, the same load line. On small random-weight llama files in each
format (written as ``bench/bench_quant_sizes.py`` writes its files) and on the real default model's Q4_1 file."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from lattice_inference.kernels import native_ops
from lattice_inference.kernels.packed_linear import QUANT
from lattice_inference.models.gguf_dequantized import load_gguf
from lattice_inference.models.gguf_quantized import (
    QuantizedEmbedding,
    attach,
    dense_embeddings,
    load_as_stored,
    quantized_weights,
)
from lattice_inference.models.load import load_model
from lattice_inference.models.source import smollm2_gguf
from lattice_inference.targets import make_target

from .helpers import assert_same_tokenizer, skip_without_real_model

skip_without_real_model()
if native_ops.quant() is None:
    pytest.skip("our quantized products do not run here", allow_module_level=True)


def _by_content(path: Path):
    model, tokenizer = load_gguf(path, torch.float32)
    attach(model, path)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def by_content():
    """``by_content(path)``: `_by_content` of a test file (the GGUF cache off: transformers dequantizes it, and its
    tokenizer is transformers' own of the file), made once per module; each call hands out a copy of the model
    (``copy.deepcopy``: targets built on it pack it) and the tokenizer."""
    made: dict[Path, tuple[nn.Module, object]] = {}

    def reference(path: Path):
        if path not in made:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("LATTICE_GGUF_CACHE", "0")
                made[path] = _by_content(path)
        model, tokenizer = made[path]
        return copy.deepcopy(model), tokenizer

    return reference


def _assert_same(built: nn.Module, reference: nn.Module) -> None:
    mine, theirs = dict(built.named_modules()), dict(reference.named_modules())
    assert mine.keys() == theirs.keys()
    for name, module in theirs.items():
        blocks, expected = getattr(mine[name], QUANT, None), getattr(module, QUANT, None)
        assert (blocks is None) == (expected is None), name
        if expected is not None:
            assert torch.equal(blocks, expected), f"{name}: other blocks or another row order"
    params = dict(built.named_parameters(remove_duplicate=False))
    embedding = built.get_input_embeddings()
    assert isinstance(embedding, QuantizedEmbedding), "the embedding stays in its blocks"
    dense = reference.get_input_embeddings().weight
    assert torch.equal(embedding.dense(), dense), "the embedding's blocks dequantize to other values"
    ids = torch.tensor([[0, 5, dense.shape[0] - 1, 5]])
    assert torch.equal(embedding(ids), reference.get_input_embeddings()(ids)), "a lookup gives other rows"
    assert embedding.weight.shape == dense.shape and embedding.weight.device.type == "meta"
    for name, expected in reference.named_parameters(remove_duplicate=False):
        if expected is dense:  # the embedding, and a tied output layer's weight: only blocks now
            assert name not in params or params[name].device.type == "meta", name
            continue
        got = params[name]
        assert got.device.type == expected.device.type, f"{name}: {got.device} against {expected.device}"
        if expected.device.type != "meta":
            assert got.dtype == expected.dtype and torch.equal(got, expected), name
    for name, expected in reference.named_buffers():
        assert torch.equal(dict(built.named_buffers())[name], expected), name
    assert quantized_weights(built).describe() == quantized_weights(reference).describe()


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])  # Q4_1: the default model's file, below
def test_a_file_loads_as_stored_as_it_attaches_by_content(fmt, tiny_gguf, by_content, monkeypatch):
    monkeypatch.setenv("LATTICE_GGUF_CACHE", "0")
    path = tiny_gguf(fmt)
    stored = load_as_stored(path)
    assert stored is not None, "a llama file must load as stored"
    built, tokenizer = stored
    reference, their_tokenizer = by_content(path)
    _assert_same(built, reference)
    assert quantized_weights(built).native[fmt] == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer; the output
    assert tokenizer.encode("Hello, world") == their_tokenizer.encode("Hello, world")
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    mine, theirs = make_target(built, prefix_cache=False), make_target(reference, prefix_cache=False)
    ours, their = mine.new_sequence(), theirs.new_sequence()
    assert torch.equal(mine.prefill(ours, ids), theirs.prefill(their, ids)), "the same model must give the same logits"
    assert torch.equal(mine.forward(ours, ids[:5]), theirs.forward(their, ids[:5]))
    attention, mlp = built.model.layers[0].self_attn, built.model.layers[0].mlp
    for members in ((attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)):
        storages = {getattr(m, QUANT).untyped_storage().data_ptr() for m in members}
        assert len(storages) == 1, "fused members hold views of the fused blocks, not copies of their own"
    embed, head = dense_embeddings(built)  # what an MTP head shares: dequantized from the blocks
    assert torch.equal(embed, reference.get_input_embeddings().weight) and head is embed
    assert dense_embeddings(built)[0] is embed, "every head shares the one dequantized copy"


def test_a_q4_k_m_file_loads_as_stored_and_names_what_it_dequantizes(tiny_gguf, by_content, monkeypatch):
    """A file of the types our products compute (K-quants, Q5_0/Q5_1, the embedding and the tied output in Q4_K) and
    F16 down projections: loaded as stored as by content, the F16 tensors named with what they cost, the same
    logits."""
    monkeypatch.setenv("LATTICE_GGUF_CACHE", "0")
    path = tiny_gguf("Q4_K_M")
    stored = load_as_stored(path)
    assert stored is not None
    built, tokenizer = stored
    reference, _ = by_content(path)
    _assert_same(built, reference)
    done = quantized_weights(built)
    assert dict(done.native) == {"Q4_K": 5, "Q6_K": 2, "Q5_K": 2, "Q5_0": 2, "Q5_1": 2}
    assert built.get_input_embeddings().kind == "Q4_K"
    assert done.dequantized == ["blk.0.ffn_down.weight (F16)", "blk.1.ffn_down.weight (F16)"]
    assert done.describe().endswith("(F16), blk.1.ffn_down.weight (F16) (0.5 MiB in the file, 1.0 MiB as float32)")
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    mine, theirs = make_target(built, prefix_cache=False), make_target(reference, prefix_cache=False)
    assert mine.native and mine._loop is not None  # q/k/v fused over Q4_K and Q6_K: the native loop runs
    ours, their = mine.new_sequence(), theirs.new_sequence()
    assert torch.equal(mine.prefill(ours, ids), theirs.prefill(their, ids))
    assert torch.equal(mine.forward(ours, ids[:5]), theirs.forward(their, ids[:5]))


def test_packing_slice_by_slice_from_the_mapped_file_gives_the_whole_tensors_blocks(tiny_gguf, by_content, monkeypatch):
    """Matrices and the tied embedding are packed 32 rows at a time here (4096 in use), each slice's rows taken in
    transformers' order (llama's q/k rows permuted across slices) and its file pages dropped: the same blocks, the
    same model, as packing each tensor whole."""
    import lattice_inference.models.gguf_quantized as quantized

    monkeypatch.setenv("LATTICE_GGUF_CACHE", "0")
    monkeypatch.setattr(quantized, "_PACK_ROWS", 32)
    path = tiny_gguf("Q4_0")
    stored = load_as_stored(path)
    assert stored is not None
    built = stored[0]
    _assert_same(built, by_content(path)[0])
    embedding, head = built.get_input_embeddings(), built.get_output_embeddings()
    assert embedding.blocks is getattr(head, QUANT), "a tied vocabulary is held once, as packed"


def test_the_default_models_file_loads_as_stored_as_it_attaches_by_content(smollm2_dequantized, monkeypatch):
    monkeypatch.setenv("LATTICE_GGUF_CACHE", "0")
    path = Path(smollm2_gguf())
    stored = load_as_stored(path)
    assert stored is not None
    # `_by_content` of the file: its uncached float32 dequantization (`load_gguf`, which that load returns; once per
    # session, shared with test_real_model), copied, then its blocks attached
    reference = copy.deepcopy(smollm2_dequantized.model)
    attach(reference, path)
    _assert_same(stored[0], reference.eval())


def test_load_model_takes_the_stored_way_for_auto(monkeypatch):
    calls: list[Path] = []
    import lattice_inference.models.load as loading

    def spy(path):
        calls.append(Path(path))
        return load_as_stored(path)

    monkeypatch.setattr(loading, "load_as_stored", spy)
    loaded = load_model("smollm2", dtype="auto")
    assert calls == [Path(smollm2_gguf())]
    assert quantized_weights(loaded.model) is not None
    load_model("smollm2", dtype="float32")
    assert len(calls) == 1, "float32 dequantizes: it must not take the stored way"


def test_the_cached_tokenizer_is_the_files_own_first_and_later(tmp_path, tiny_gguf, by_content, monkeypatch):
    """The first load (transformers reads the file's vocabulary, then the cache is written) and a later one (the
    cache's ``tokenizer.json`` read in one pass, `gguf_dequantized.saved_tokenizer`) give tokenizers that encode, decode
    and template as transformers' own tokenizer of the file."""
    monkeypatch.setenv("LATTICE_CACHE_DIR", str(tmp_path / "cache"))
    path = tiny_gguf("Q8_0")
    # transformers' own: ``AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)``, as `load_gguf` reads it
    # uncached (made once per module)
    theirs = by_content(path)[1]
    first = load_as_stored(path)
    later = load_as_stored(path)
    assert first is not None and later is not None
    assert any((tmp_path / "cache").rglob("tokenizer.json")), "the first load caches the tokenizer"
    for loaded in (first, later):
        assert_same_tokenizer(loaded[1], theirs)
