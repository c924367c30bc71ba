"""Read the MTP head's tensors straight from a checkpoint's safetensors.

transformers drops every ``mtp.*`` tensor at load (``_keys_to_ignore_on_load_unexpected = [r"^mtp.*"]``) without a
word, so the project reads them itself with ``safetensors.safe_open``: from one ``model.safetensors`` or from the
shards listed in ``model.safetensors.index.json``, touching only the tensors it needs.

Three MLP layouts exist in released checkpoints and are detected from the tensor names:

* ``fused``: ``mtp.layers.0.mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and ``...experts.down_proj``
  ``[E, H, I]``, no ``.weight`` suffix (Qwen3.6-35B-A3B);
* ``per_expert``: ``mtp.layers.0.mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen3-Next-80B-A3B,
  Qwen3.5-35B-A3B); stacked here into the fused form;
* ``dense``: ``mtp.layers.0.mlp.{gate,up,down}_proj.weight`` (dense Qwen3.5).

Everything (presence, quantisation, layer count, layout, shapes, dtypes) is validated from the file metadata before a
single tensor is read, so an error never leaves anything half-built.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from lattice_inference.errors import ModelLoadError
from lattice_inference.mtp.config import MtpConfig

FUSED = "fused"
PER_EXPERT = "per_expert"
DENSE = "dense"

EMBED_NAMES = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
LM_HEAD_NAME = "lm_head.weight"

_FLOAT_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_QUANT_SUFFIXES = (
    "weight_scale_inv",
    "weight_scale",
    "input_scale",
    "weight_global_scale",
    "input_global_scale",
    "scales",
    "qweight",
    "qzeros",
    "g_idx",
    "weight_packed",
    "weight_shape",
    "weight_zero_point",
    "absmax",
    "quant_map",
    "quant_state",
    "nested_absmax",
    "SCB",
)
_PER_EXPERT_RE = re.compile(r"^mtp\.layers\.0\.mlp\.experts\.(\d+)\.")
_LAYER_RE = re.compile(r"^mtp\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """Name, shape, safetensors dtype string and file of one stored tensor."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    file: Path


@dataclasses.dataclass(frozen=True)
class MtpWeights:
    """Every tensor of one MTP head, in torch layout (``nn.Linear`` weights are ``[out, in]``).

    MoE heads fill ``router``, ``experts_gate_up`` ``[E, 2I, H]`` (gate rows first), ``experts_down`` ``[E, H, I]``,
    the shared expert and ``shared_expert_gate`` ``[1, H]``; dense heads fill ``mlp_gate``/``mlp_up``/``mlp_down``.
    ``embed_tokens`` and ``lm_head`` (``[V, H]``) come from the target trunk; with tied embeddings they are the
    same tensor.
    """

    fc: torch.Tensor
    pre_fc_norm_embedding: torch.Tensor
    pre_fc_norm_hidden: torch.Tensor
    norm: torch.Tensor
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    embed_tokens: torch.Tensor
    lm_head: torch.Tensor
    layout: str
    router: torch.Tensor | None = None
    experts_gate_up: torch.Tensor | None = None
    experts_down: torch.Tensor | None = None
    shared_gate: torch.Tensor | None = None
    shared_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    shared_expert_gate: torch.Tensor | None = None
    mlp_gate: torch.Tensor | None = None
    mlp_up: torch.Tensor | None = None
    mlp_down: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the projection weights."""
        return self.fc.dtype

    def validate(self, cfg: MtpConfig) -> None:
        """Check every tensor's shape against ``cfg`` and that all share one float dtype (``ModelLoadError``)."""
        h, hd, n_h, n_kv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        shapes: dict[str, tuple[int, ...]] = {
            "fc": (h, 2 * h),
            "pre_fc_norm_embedding": (h,),
            "pre_fc_norm_hidden": (h,),
            "norm": (h,),
            "input_layernorm": (h,),
            "post_attention_layernorm": (h,),
            "q_proj": (2 * n_h * hd, h),
            "k_proj": (n_kv * hd, h),
            "v_proj": (n_kv * hd, h),
            "o_proj": (h, n_h * hd),
            "q_norm": (hd,),
            "k_norm": (hd,),
            "embed_tokens": (cfg.vocab_size, h),
            "lm_head": (cfg.vocab_size, h),
        }
        if cfg.is_moe:
            e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            shapes |= {
                "router": (e, h),
                "experts_gate_up": (e, 2 * i, h),
                "experts_down": (e, h, i),
                "shared_gate": (s, h),
                "shared_up": (s, h),
                "shared_down": (h, s),
                "shared_expert_gate": (1, h),
            }
        else:
            i = int(cfg.intermediate_size or 0)
            shapes |= {"mlp_gate": (i, h), "mlp_up": (i, h), "mlp_down": (h, i)}
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ModelLoadError(f"MTP weights must be float32 or bfloat16, got {self.dtype}")
        for field, expected in shapes.items():
            tensor = getattr(self, field)
            if tensor is None:
                raise ModelLoadError(
                    f"MTP weight {field} is missing (needed by a {'MoE' if cfg.is_moe else 'dense'} head)"
                )
            if tuple(tensor.shape) != expected:
                raise ModelLoadError(
                    f"MTP weight {field} has the wrong shape: expected {list(expected)}, actual {list(tensor.shape)}"
                )
            if tensor.dtype != self.dtype or tensor.device != self.fc.device:
                raise ModelLoadError(
                    f"MTP weight {field} is {tensor.dtype} on {tensor.device}; "
                    f"expected {self.dtype} on {self.fc.device}"
                )


# --------------------------------------------------------------------------------------------- checkpoint index


def index_checkpoint(model_dir: str | Path) -> dict[str, Path]:
    """Map every tensor name of the checkpoint in ``model_dir`` to the safetensors file holding it.

    Uses ``model.safetensors.index.json`` when present (sharded), else ``model.safetensors``, else every
    ``*.safetensors`` file in the directory; ``model_dir`` may also be one ``.safetensors`` file.
    """
    root = Path(model_dir)
    if root.is_file() and root.suffix == ".safetensors":  # a stand-alone head file (mtp.head_file)
        return dict.fromkeys(_keys(root), root)
    if not root.is_dir():
        raise ModelLoadError(f"model directory {root} does not exist")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read the shard index {index}: {exc}") from exc
        files = {name: root / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise ModelLoadError(f"shard {shard.name} listed in {index.name} is missing from {root}")
        return files
    single = root / "model.safetensors"
    paths = [single] if single.is_file() else sorted(root.glob("*.safetensors"))
    if not paths:
        raise ModelLoadError(f"no safetensors checkpoint in {root} (model.safetensors or a sharded index)")
    files: dict[str, Path] = {}
    for path in paths:
        for name in _keys(path):
            files[name] = path
    return files


def _keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys())
    except Exception as exc:  # safetensors raises its own error types
        raise ModelLoadError(f"cannot read safetensors file {path}: {exc}") from exc


def read_metadata(files: Mapping[str, Path], names: Iterable[str]) -> dict[str, TensorMeta]:
    """Shapes and dtypes of ``names`` from the file headers (no tensor data is read)."""
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    metas: dict[str, TensorMeta] = {}
    for path, group in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in group:
                    sl = handle.get_slice(name)
                    metas[name] = TensorMeta(name, tuple(sl.get_shape()), sl.get_dtype(), path)
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"cannot read tensor metadata from {path}: {exc}") from exc
    return metas


# --------------------------------------------------------------------------------------------- planning


def detect_layout(names: Iterable[str]) -> str | None:
    """Return ``fused``, ``per_expert`` or ``dense`` from the ``mtp.*`` names, or None if no MLP is found.

    Raises ``ModelLoadError`` when both expert layouts are present.
    """
    names = set(names)
    fused = any(n in names for n in ("mtp.layers.0.mlp.experts.gate_up_proj", "mtp.layers.0.mlp.experts.down_proj"))
    per_expert = any(_PER_EXPERT_RE.match(n) for n in names)
    if fused and per_expert:
        raise ModelLoadError(
            "checkpoint mixes the fused (mtp.layers.0.mlp.experts.gate_up_proj) and the per-expert "
            "(mtp.layers.0.mlp.experts.{e}.*) MTP expert layouts"
        )
    if fused:
        return FUSED
    if per_expert:
        return PER_EXPERT
    if "mtp.layers.0.mlp.gate_proj.weight" in names or "mtp.layers.0.mlp.up_proj.weight" in names:
        return DENSE
    return None


def _expected_shapes(cfg: MtpConfig, layout: str) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> expected shape for every ``mtp.*`` tensor of ``layout``."""
    h, hd = cfg.hidden_size, cfg.head_dim
    p = "mtp.layers.0."
    shapes: dict[str, tuple[int, ...]] = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (2 * cfg.num_attention_heads * hd, h),
        p + "self_attn.k_proj.weight": (cfg.num_key_value_heads * hd, h),
        p + "self_attn.v_proj.weight": (cfg.num_key_value_heads * hd, h),
        p + "self_attn.o_proj.weight": (h, cfg.num_attention_heads * hd),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
    }
    if layout == DENSE:
        i = int(cfg.intermediate_size or 0)
        shapes.update(
            {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)}
        )
        return shapes
    e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    shapes.update(
        {
            p + "mlp.gate.weight": (e, h),
            p + "mlp.shared_expert.gate_proj.weight": (s, h),
            p + "mlp.shared_expert.up_proj.weight": (s, h),
            p + "mlp.shared_expert.down_proj.weight": (h, s),
            p + "mlp.shared_expert_gate.weight": (1, h),
        }
    )
    if layout == FUSED:
        shapes[p + "mlp.experts.gate_up_proj"] = (e, 2 * i, h)
        shapes[p + "mlp.experts.down_proj"] = (e, h, i)
    else:
        for j in range(e):
            shapes[f"{p}mlp.experts.{j}.gate_proj.weight"] = (i, h)
            shapes[f"{p}mlp.experts.{j}.up_proj.weight"] = (i, h)
            shapes[f"{p}mlp.experts.{j}.down_proj.weight"] = (h, i)
    return shapes


def _check_quantised(mtp_names: Iterable[str], metas: Mapping[str, TensorMeta]) -> None:
    for name in sorted(mtp_names):
        last = name.rsplit(".", 1)[-1]
        if last in _QUANT_SUFFIXES:
            raise ModelLoadError(
                f"quantised MTP weights are not supported: the checkpoint stores quantisation tensor {name}; "
                "use a bfloat16/float32 checkpoint of the model"
            )
    for meta in metas.values():
        if meta.dtype not in _FLOAT_DTYPES:
            kind = "quantised MTP weights are" if meta.name.startswith("mtp.") else "quantised trunk embeddings are"
            raise ModelLoadError(
                f"{kind} not supported: tensor {meta.name} is stored as {meta.dtype} "
                f"(expected one of {sorted(_FLOAT_DTYPES)})"
            )


def _check_shape(meta: TensorMeta, expected: tuple[int, ...], cfg: MtpConfig) -> None:
    actual = meta.shape
    if meta.name == "mtp.fc.weight" and actual != expected:
        raise ModelLoadError(
            f"unexpected mtp.fc.weight shape {list(actual)}; expected fusion projection "
            f"[{cfg.hidden_size}, {2 * cfg.hidden_size}] (tensor mtp.fc.weight: expected {list(expected)}, "
            f"actual {list(actual)})"
        )
    if meta.name.endswith("mlp.shared_expert_gate.weight"):
        numel = 1
        for d in actual:
            numel *= d
        if numel == cfg.hidden_size:  # the reference accepts [H] as well as [1, H]
            return
    if actual != expected:
        raise ModelLoadError(
            f"tensor {meta.name} has the wrong shape: expected {list(expected)}, actual {list(actual)}"
        )


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """The validated list of tensors to read: mtp shapes, the layout and the trunk embedding/head names."""

    layout: str
    mtp: dict[str, TensorMeta]
    embed: TensorMeta | None
    lm_head: TensorMeta | None


def plan_load(
    files: Mapping[str, Path], cfg: MtpConfig, *, need_embed: bool = True, need_lm_head: bool = True
) -> LoadPlan:
    """Validate the checkpoint against ``cfg`` from metadata only and return what to read.

    Raises ``ModelLoadError`` for: no ``mtp.*`` tensors, quantised tensors, extra MTP layers, an unknown or
    config-inconsistent MLP layout, a missing tensor or expert, or a wrong shape (name, expected, actual).
    """
    mtp_names = sorted(n for n in files if n.startswith("mtp."))
    if not mtp_names:
        raise ModelLoadError(
            "checkpoint has no MTP weights (no 'mtp.*' tensors). transformers' from_pretrained drops them "
            "silently, so a checkpoint re-saved with save_pretrained (or a stripped/quantised export) has none; "
            "use the original release files"
        )
    _check_quantised(mtp_names, {})
    layers = sorted({int(m.group(1)) for n in mtp_names if (m := _LAYER_RE.match(n))})
    if layers and layers != [0]:
        raise ModelLoadError(
            f"checkpoint has MTP layers {layers}, but only a single MTP layer (mtp.layers.0) is supported"
        )
    layout = detect_layout(mtp_names)
    if cfg.is_moe and layout == DENSE:
        raise ModelLoadError(
            f"config declares a MoE MTP head (num_experts={cfg.num_experts}) but the checkpoint has a dense "
            "MTP MLP (mtp.layers.0.mlp.gate_proj.weight)"
        )
    if not cfg.is_moe and layout in (FUSED, PER_EXPERT):
        raise ModelLoadError(
            f"config declares a dense MTP head (num_experts=0) but the checkpoint has MTP experts ({layout} layout)"
        )
    if layout is None:
        layout = FUSED if cfg.is_moe else DENSE
        if cfg.is_moe:
            raise ModelLoadError(
                "checkpoint has no MTP expert tensors: missing tensor mtp.layers.0.mlp.experts.gate_up_proj "
                "(fused layout) or mtp.layers.0.mlp.experts.0.gate_proj.weight (per-expert layout)"
            )
    expected = _expected_shapes(cfg, layout)
    if layout == PER_EXPERT:
        _check_experts(files, cfg)
    missing = [n for n in expected if n not in files]
    if missing:
        raise ModelLoadError(
            f"missing MTP tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    embed_name = next((n for n in EMBED_NAMES if n in files), None) if need_embed else None
    if need_embed and embed_name is None:
        raise ModelLoadError(f"missing embedding tensor: none of {list(EMBED_NAMES)} is in the checkpoint")
    head_name = None
    if need_lm_head and not cfg.tie_word_embeddings:
        if LM_HEAD_NAME not in files:
            raise ModelLoadError(
                f"missing tensor {LM_HEAD_NAME} (tie_word_embeddings is false, so the MTP needs the target's lm_head)"
            )
        head_name = LM_HEAD_NAME
    wanted = list(expected) + [n for n in (embed_name, head_name) if n is not None]
    metas = read_metadata(files, wanted)
    _check_quantised([], metas)
    for name, shape in expected.items():
        _check_shape(metas[name], shape, cfg)
    vocab_shape = (cfg.vocab_size, cfg.hidden_size)
    for name in (embed_name, head_name):
        if name is not None and metas[name].shape != vocab_shape:
            raise ModelLoadError(
                f"tensor {name} has the wrong shape: expected {list(vocab_shape)} (vocab_size, hidden_size), "
                f"actual {list(metas[name].shape)}"
            )
    return LoadPlan(
        layout=layout,
        mtp={n: metas[n] for n in expected},
        embed=metas[embed_name] if embed_name else None,
        lm_head=metas[head_name] if head_name else None,
    )


def _check_experts(files: Mapping[str, Path], cfg: MtpConfig) -> None:
    present = {int(m.group(1)) for n in files if (m := _PER_EXPERT_RE.match(n))}
    extra = sorted(e for e in present if e >= cfg.num_experts)
    if extra:
        raise ModelLoadError(f"checkpoint has MTP expert {extra[0]} but config declares num_experts={cfg.num_experts}")
    for e in range(cfg.num_experts):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            name = f"mtp.layers.0.mlp.experts.{e}.{proj}.weight"
            if name not in files:
                raise ModelLoadError(
                    f"missing MTP expert {e}: tensor {name} not found (the per-expert layout needs experts "
                    f"0..{cfg.num_experts - 1})"
                )


# --------------------------------------------------------------------------------------------- loading


def _read(plan_metas: Iterable[TensorMeta], dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for meta in plan_metas:
        by_file.setdefault(meta.file, []).append(meta.name)
    out: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as handle:
            for name in names:
                out[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
    return out


def load_mtp_weights(
    model_dir: str | Path,
    cfg: MtpConfig,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    embed_tokens: torch.Tensor | None = None,
    lm_head: torch.Tensor | None = None,
) -> MtpWeights:
    """Validate and read the MTP tensors of the checkpoint in ``model_dir``.

    ``dtype`` None keeps bfloat16 checkpoints in bfloat16 and loads anything else as float32. ``embed_tokens`` /
    ``lm_head`` may be passed to share the target model's tensors instead of reading a second copy.
    """
    files = index_checkpoint(model_dir)
    plan = plan_load(files, cfg, need_embed=embed_tokens is None, need_lm_head=lm_head is None)
    if dtype is None:
        dtype = torch.bfloat16 if plan.mtp["mtp.fc.weight"].dtype == "BF16" else torch.float32
    if dtype not in (torch.float32, torch.bfloat16):
        raise ModelLoadError(f"MTP dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    vocab_shape = (cfg.vocab_size, cfg.hidden_size)
    for label, given in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
        if given is not None and tuple(given.shape) != vocab_shape:
            raise ModelLoadError(
                f"given {label} has the wrong shape: expected {list(vocab_shape)}, actual {list(given.shape)}"
            )
    metas = list(plan.mtp.values()) + [m for m in (plan.embed, plan.lm_head) if m is not None]
    raw = _read(metas, dtype, device)
    embed = embed_tokens.to(device=device, dtype=dtype) if embed_tokens is not None else raw[plan.embed.name]
    if lm_head is not None:
        head = lm_head.to(device=device, dtype=dtype)
    elif cfg.tie_word_embeddings:
        head = embed
    else:
        head = raw[LM_HEAD_NAME]
    return _assemble(raw, plan.layout, cfg, embed, head)


def _assemble(
    raw: Mapping[str, torch.Tensor], layout: str, cfg: MtpConfig, embed: torch.Tensor, head: torch.Tensor
) -> MtpWeights:
    p = "mtp.layers.0."
    common = {
        "fc": raw["mtp.fc.weight"],
        "pre_fc_norm_embedding": raw["mtp.pre_fc_norm_embedding.weight"],
        "pre_fc_norm_hidden": raw["mtp.pre_fc_norm_hidden.weight"],
        "norm": raw["mtp.norm.weight"],
        "input_layernorm": raw[p + "input_layernorm.weight"],
        "post_attention_layernorm": raw[p + "post_attention_layernorm.weight"],
        "q_proj": raw[p + "self_attn.q_proj.weight"],
        "k_proj": raw[p + "self_attn.k_proj.weight"],
        "v_proj": raw[p + "self_attn.v_proj.weight"],
        "o_proj": raw[p + "self_attn.o_proj.weight"],
        "q_norm": raw[p + "self_attn.q_norm.weight"],
        "k_norm": raw[p + "self_attn.k_norm.weight"],
        "embed_tokens": embed,
        "lm_head": head,
        "layout": layout,
    }
    if layout == DENSE:
        return MtpWeights(
            **common,
            mlp_gate=raw[p + "mlp.gate_proj.weight"],
            mlp_up=raw[p + "mlp.up_proj.weight"],
            mlp_down=raw[p + "mlp.down_proj.weight"],
        )
    if layout == FUSED:
        gate_up = raw[p + "mlp.experts.gate_up_proj"]
        down = raw[p + "mlp.experts.down_proj"]
    else:
        experts = range(cfg.num_experts)
        gate_up = torch.stack(
            [
                torch.cat([raw[f"{p}mlp.experts.{e}.gate_proj.weight"], raw[f"{p}mlp.experts.{e}.up_proj.weight"]])
                for e in experts
            ]
        )
        down = torch.stack([raw[f"{p}mlp.experts.{e}.down_proj.weight"] for e in experts])
    return MtpWeights(
        **common,
        router=raw[p + "mlp.gate.weight"],
        experts_gate_up=gate_up,
        experts_down=down,
        shared_gate=raw[p + "mlp.shared_expert.gate_proj.weight"],
        shared_up=raw[p + "mlp.shared_expert.up_proj.weight"],
        shared_down=raw[p + "mlp.shared_expert.down_proj.weight"],
        shared_expert_gate=raw[p + "mlp.shared_expert_gate.weight"].reshape(1, cfg.hidden_size),
    )
