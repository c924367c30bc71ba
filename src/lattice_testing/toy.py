"""Small random-weight models and a byte-level tokenizer, built locally, for tests, benchmarks and demos.

Nothing here downloads anything: configs come from transformers' config classes and the tokenizer is a plain
byte-level BPE with no merges (one token per byte) plus a few special tokens. With a small init (std 0.02)
random models fall into short loops, which prompt lookup drafts well; with a large init they produce diverse
tokens that never copy. Neither says anything about real acceptance; they exercise the mechanics.

Run ``python -m lattice_testing.toy DIR [--arch qwen3]`` to write one to ``DIR``.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A transformers tokenizer with one token per byte (ids 0-255) and `SPECIAL_TOKENS` after them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def _byte_of(ch: str) -> int:
    """The byte that GPT-2's byte-to-unicode table maps to the printable character ``ch``."""
    return _byte_table()[ch]


@functools.cache
def _byte_table() -> dict[str, int]:
    """GPT-2's byte-to-unicode table inverted (built once: the tiny models of the tests and the sweep each ask)."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1))
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return table


TOY_VOCAB = 256 + len(SPECIAL_TOKENS)


def toy_config(arch: str = "qwen3", vocab_size: int = TOY_VOCAB, **overrides: object) -> PretrainedConfig:
    """A tiny config (hidden 64, 2 layers) of the named architecture, with ``overrides`` applied."""
    from transformers import AutoConfig

    common: dict[str, object] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=256,
        eos_token_id=256,
        pad_token_id=256,
    )
    per_arch: dict[str, dict[str, object]] = {
        "qwen3": dict(head_dim=16),
        "llama": dict(head_dim=16),
        "qwen2": dict(),
        "mistral": dict(head_dim=16, sliding_window=24),
        "gemma": dict(head_dim=16),
        "gemma2": dict(head_dim=16, sliding_window=24, query_pre_attn_scalar=16),
        "gemma3_text": dict(head_dim=16, sliding_window=24, query_pre_attn_scalar=16, sliding_window_pattern=2),
        "phi3": dict(),
    }
    if arch not in per_arch:
        raise ValueError(f"unknown toy architecture {arch!r}; choose from {sorted(per_arch)}")
    kwargs = {**common, **per_arch[arch], **overrides}
    return AutoConfig.for_model(arch, **kwargs)


def qwen35_08b_shape_config(**overrides: object) -> PretrainedConfig:
    """The assumed Qwen3.5-0.8B text shape, for benchmarks (not read from a hub checkpoint): hidden 1024, 24 layers
    (18 Gated DeltaNet + 6 gated full attention), 8/2 heads of 256, delta-net 16/16 heads of 128, intermediate
    3584, vocab 248320, tied embeddings, one MTP layer."""
    from transformers import Qwen3_5TextConfig

    kwargs: dict[str, object] = dict(
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        mtp_num_hidden_layers=1,
    )
    return Qwen3_5TextConfig(**{**kwargs, **overrides})


TOY_ARCHITECTURES = ("qwen3", "llama", "qwen2", "mistral", "gemma", "gemma2", "phi3")


def toy_model(config: PretrainedConfig, *, init_std: float = 0.02, seed: int = 0) -> PreTrainedModel:
    """A random-weight causal LM for ``config``, every weight drawn from N(0, init_std), in float32."""
    torch.manual_seed(seed)
    config.initializer_range = init_std
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue
            p.normal_(0.0, init_std)
    return model.eval()


def save_toy_model_dir(
    path: str | Path, arch: str = "qwen3", *, init_std: float = 0.02, seed: int = 0, **overrides: object
) -> Path:
    """Write a toy model with the byte tokenizer to ``path`` (config, safetensors, tokenizer files)."""
    path = Path(path)
    tok = byte_tokenizer()
    cfg = toy_config(arch, vocab_size=TOY_VOCAB, **overrides)
    cfg.eos_token_id = tok.eos_token_id
    cfg.bos_token_id = tok.eos_token_id
    model = toy_model(cfg, init_std=init_std, seed=seed)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "TOY_MODEL.json").write_text(json.dumps({"arch": arch, "init_std": init_std, "seed": seed}))
    return path


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: write a toy model directory."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="output directory")
    parser.add_argument("--arch", default="qwen3", choices=TOY_ARCHITECTURES)
    parser.add_argument("--init-std", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = save_toy_model_dir(args.dir, args.arch, init_std=args.init_std, seed=args.seed)
    print(f"wrote a random-weight {args.arch} toy model to {out}")


if __name__ == "__main__":
    main()
