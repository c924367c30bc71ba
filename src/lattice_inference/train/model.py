"""The trainable MTP head: the parameters of one dense MTP layer, run through `lattice_inference.mtp.layer`.

`TrainableHead.forward` is the drafting head's function (same `mtp_layer`, same norms, RoPE and attention math),
batched over whole sequences with causal attention instead of a KV cache: row ``t`` pairs the target's
post-norm hidden ``h_t`` with the token ``x_{t+1}`` at position ``t``, and its output, scored by the target's
``lm_head``, predicts ``x_{t+2}``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from lattice_inference.errors import ModelLoadError
from lattice_inference.hybrid_families import is_hybrid_model_type
from lattice_inference.mtp.config import MtpConfig
from lattice_inference.mtp.layer import LayerTensors, gqa_attention, mtp_layer, rope_inv_freq, swiglu

_P = "mtp.layers.0."
#: parameter name -> checkpoint name (the dense ``mtp.*`` layout `lattice_inference.mtp.weights` reads).
CHECKPOINT_NAMES = {
    "fc": "mtp.fc.weight",
    "pre_fc_norm_embedding": "mtp.pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden": "mtp.pre_fc_norm_hidden.weight",
    "norm": "mtp.norm.weight",
    "input_layernorm": _P + "input_layernorm.weight",
    "post_attention_layernorm": _P + "post_attention_layernorm.weight",
    "q_proj": _P + "self_attn.q_proj.weight",
    "k_proj": _P + "self_attn.k_proj.weight",
    "v_proj": _P + "self_attn.v_proj.weight",
    "o_proj": _P + "self_attn.o_proj.weight",
    "q_norm": _P + "self_attn.q_norm.weight",
    "k_norm": _P + "self_attn.k_norm.weight",
    "mlp_gate": _P + "mlp.gate_proj.weight",
    "mlp_up": _P + "mlp.up_proj.weight",
    "mlp_down": _P + "mlp.down_proj.weight",
}


class TrainableHead(nn.Module):
    """A dense MTP layer sized by ``cfg`` (norm weights zero-centred: 0 is the identity)."""

    def __init__(self, cfg: MtpConfig, std: float = 0.02) -> None:
        super().__init__()
        self.cfg = cfg
        h, n_h, n_kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        inter = int(cfg.intermediate_size or 0)
        shapes = {
            "fc": (h, 2 * h),
            "q_proj": (2 * n_h * hd, h),
            "k_proj": (n_kv * hd, h),
            "v_proj": (n_kv * hd, h),
            "o_proj": (h, n_h * hd),
            "mlp_gate": (inter, h),
            "mlp_up": (inter, h),
            "mlp_down": (h, inter),
        }
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape) * std))
        for name, size in (
            ("pre_fc_norm_embedding", h),
            ("pre_fc_norm_hidden", h),
            ("norm", h),
            ("input_layernorm", h),
            ("post_attention_layernorm", h),
            ("q_norm", hd),
            ("k_norm", hd),
        ):
            self.register_parameter(name, nn.Parameter(torch.zeros(size)))
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope_theta, cfg.rotary_dim), persistent=False)

    def layer_tensors(self) -> LayerTensors:
        """The tensors `mtp_layer` takes, built differentiably from the parameters."""
        return LayerTensors.of(self)

    def forward(self, hidden: torch.Tensor, next_tokens: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        """Post-norm MTP output ``[B, n, H]`` for target hiddens ``[B, n, H]`` and tokens ``[B, n]`` (causal)."""
        return self.forward_chain(hidden, next_tokens, embed, 1)[0]

    def forward_chain(
        self, hidden: torch.Tensor, next_tokens: torch.Tensor, embed: torch.Tensor, depth: int
    ) -> list[torch.Tensor]:
        """Outputs of draft steps ``1..depth`` over a whole window, each step chained as `MtpHead.draft_tokens`
        chains it: step ``j`` (0-based) feeds step ``j-1``'s own output at position ``p - 1`` with the token
        ``x_{p+1}`` at position ``p`` and attends to what the head's KV cache would hold there (`chain_mask`).
        Step ``j``'s output ``[B, n - j, H]`` covers positions ``j..n-1`` and predicts ``x_{p+2}``; step 0 is
        the plain causal `forward`. Training later steps this way is EAGLE-3's training-time test: the head
        learns from its own hiddens, which is what it drafts from after the first token."""
        cfg = self.cfg
        scale = cfg.head_dim**-0.5
        gate_up = torch.cat([self.mlp_gate, self.mlp_up], dim=0)
        tensors = self.layer_tensors()
        n = int(next_tokens.shape[-1])
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        hid = hidden.to(self.fc.dtype)
        for j in range(min(depth, n)):

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, j: int = j) -> torch.Tensor:
                keys.append(k)
                values.append(v)
                if j == 0:
                    return gqa_attention(q, k, v, 0, scale)
                mask = chain_mask(n, j, q.device)
                return gqa_attention(q, torch.cat(keys, -3), torch.cat(values, -3), 0, scale, allowed=mask)

            out = mtp_layer(
                tensors,
                embed[next_tokens[..., j:]],
                hid,
                cfg,
                inv_freq=self.inv_freq,
                start=j,
                attend=attend,
                mlp=lambda y: swiglu(y, gate_up, self.mlp_down),
            )
            outs.append(out)
            hid = out[..., :-1, :]
        return outs

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The parameters under their ``mtp.*`` checkpoint names."""
        return {ckpt: getattr(self, name).detach() for name, ckpt in CHECKPOINT_NAMES.items()}

    @torch.no_grad()
    def init_from_tensors(self, tensors: Mapping[str, torch.Tensor], source: str) -> None:
        """Start from a saved head's ``mtp.*`` tensors (fine-tuning a head, e.g. the shipped one, on new data)
        rather than from the target's last layer. Every parameter must be present with its shape; ``source``
        names the head in the error."""
        for name, ckpt in CHECKPOINT_NAMES.items():
            dst = getattr(self, name)
            src = tensors.get(ckpt)
            if src is None:
                raise ModelLoadError(f"MTP head '{source}' lacks tensor {ckpt}")
            if tuple(src.shape) != tuple(dst.shape):
                raise ModelLoadError(
                    f"MTP head '{source}': tensor {ckpt} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(src)

    @torch.no_grad()
    def init_from_target(self, model: nn.Module) -> None:
        """Warm start from the target's last decoder layer where shapes agree: attention and MLP weights, norms
        (converted to zero-centred form for targets with plain ``w`` RMSNorms), the final norm; ``fc`` starts as
        the identity on the hidden half. Gates start at zero (``sigmoid`` 0.5)."""
        layer = model.model.layers[-1]
        zero_centred = is_hybrid_model_type(getattr(model.config, "model_type", None))

        def norm(dst: torch.Tensor, src: nn.Module | None) -> None:
            w = getattr(src, "weight", None)
            if w is not None and w.shape == dst.shape:
                dst.copy_(w.float() if zero_centred else w.float() - 1.0)

        attn = getattr(layer, "self_attn", None)
        cfg = self.cfg
        hd, n_h = cfg.head_dim, cfg.num_attention_heads
        if attn is not None and getattr(attn, "q_proj", None) is not None:
            q = attn.q_proj.weight.float()
            if q.shape == (n_h * hd, cfg.hidden_size):  # plain query rows: place them, zero the gate rows
                view = self.q_proj.view(n_h, 2 * hd, cfg.hidden_size)
                view[:, :hd] = q.view(n_h, hd, cfg.hidden_size)
                view[:, hd:] = 0.0
            elif q.shape == self.q_proj.shape:
                self.q_proj.copy_(q)
            for name in ("k_proj", "v_proj", "o_proj"):
                src = getattr(attn, name).weight
                if src.shape == getattr(self, name).shape:
                    getattr(self, name).copy_(src.float())
            norm(self.q_norm, getattr(attn, "q_norm", None))
            norm(self.k_norm, getattr(attn, "k_norm", None))
        mlp = getattr(layer, "mlp", None)
        for name, src in (("mlp_gate", "gate_proj"), ("mlp_up", "up_proj"), ("mlp_down", "down_proj")):
            w = getattr(getattr(mlp, src, None), "weight", None)
            if w is not None and w.shape == getattr(self, name).shape:
                getattr(self, name).copy_(w.float())
        norm(self.input_layernorm, getattr(layer, "input_layernorm", None))
        norm(self.post_attention_layernorm, getattr(layer, "post_attention_layernorm", None))
        norm(self.norm, getattr(model.model, "norm", None))
        h = cfg.hidden_size
        self.fc.zero_()
        self.fc[:, h:] = torch.eye(h)
        self.fc[:, :h].normal_(std=0.02)


def chain_mask(n: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Which keys draft step ``step`` (0-based, >= 1) may read in a window of ``n`` positions: ``[n - step, L]``
    bool over the keys of steps ``0..step`` laid side by side (step ``k`` holds positions ``k..n-1``).

    The query at position ``p`` is the ``step``-th chained draft from the target hidden at ``t = p - step``. When
    drafting, the head's cache then holds rows computed from target hiddens at positions ``0..t`` and this
    chain's own earlier drafts at ``t+1..p-1``, so: step 0's keys at positions ``<= t``, and step ``k``'s key at
    position ``t + k`` only."""
    pos = torch.arange(step, n, device=device)[:, None]
    cols = [torch.arange(0, n, device=device)[None, :] <= pos - step]
    cols += [torch.arange(k, n, device=device)[None, :] == pos - step + k for k in range(1, step + 1)]
    return torch.cat(cols, dim=1)
