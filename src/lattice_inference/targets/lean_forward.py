"""The lean forward's two strategies over a decoder's own modules and weights, each a runner of the layers:
`NativeForward` (the native ops: the one-call layer loop where every product's row plan is 1, else per-layer native
calls; any number of sequences in one call) and `TorchForward` (the PyTorch path: attention by `block_attention` for
decode-matched rows, transformers' ``sdpa`` call otherwise). `LeanTarget` builds them once, at construction, and picks
per forward only what the forward is (a matched forward or a short prompt: native where it runs; a long prompt or an
unmatched forward: the PyTorch path's flash attention). Also the layers' data (`Layer`, `LayerLoop`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from lattice_inference.kernels import decode_matched
from lattice_inference.kernels.decode_matched import Product, RowPlan
from lattice_inference.kernels.packed_linear import packed_operands, products
from lattice_inference.targets.block_attention import block_attention, plan_blocks

if TYPE_CHECKING:
    from lattice_inference.targets.transformers import FedRows

Tables = dict[str | None, tuple[torch.Tensor, torch.Tensor]]
"""Per rotary kind of the layers (None: the model's one table), the cos and sin tables of the rows' positions."""


def head_dim_of(config: PretrainedConfig) -> int:
    """The attention heads' width: ``head_dim`` where the config gives it, else hidden size over heads."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


class TorchForward:
    """The layers through PyTorch: each layer's norms, products (packed, fused, decode-matched), q/k norms,
    ``apply_rotary_pos_emb``, the cache write (rounded to ``kv_dtype``), attention, the MLP; attention by
    `block_attention` for decode-matched rows (fixed-shape float32 blocks, each row computed the same way at any
    width), else transformers' ``sdpa`` call under the causal (or tree, or window) mask."""

    def __init__(self, model: PreTrainedModel, layers: list[Layer], kv_dtype: torch.dtype) -> None:
        text = model.config
        self.decoder = model.model
        self.layers = layers
        self.kv_dtype = kv_dtype
        self.head_dim = head_dim_of(text)
        self.groups = text.num_attention_heads // text.num_key_value_heads
        self.rope_kinds = rope_kinds(layers)
        self.rotary = sys.modules[type(model).__module__].apply_rotary_pos_emb

    def hidden(self, cache: DynamicCache, start: int, fed: FedRows, matched: bool) -> torch.Tensor:
        """The decoder's hidden states after its final norm, ``[1, n, hidden]``, for the ``fed`` rows after ``start``
        cached rows, writing each layer's keys and values there; ``matched``: decode-matched rows."""
        ids, positions, mask = fed.ids, fed.positions, fed.mask
        n, head_dim, device = ids.shape[1], self.head_dim, ids.device
        blocks = None
        if matched:
            blocks = plan_blocks(start, n, None if mask is None else seen_rows(mask, start), self.groups, device)
        elif mask is None and 1 < n and start > 0:
            # rows at once over a cache: the causal mask transformers' sdpa_mask builds for this case
            mask = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(start)[None, None]
        decoder = self.decoder
        x = decoder.embed_tokens(ids)
        ropes = {}
        for kind in self.rope_kinds:
            ropes[kind] = decoder.rotary_emb(x, positions) if kind is None else decoder.rotary_emb(x, positions, kind)
        span = 0 if blocks is None else max(block.reach for block in blocks)
        for layer, kv in zip(self.layers, cache.layers, strict=True):
            attn = layer.attn
            h = layer.input_norm(x)
            q, k, v = run_products(layer.qkv, h)
            q, k, v = q.view(1, n, -1, head_dim), k.view(1, n, -1, head_dim), v.view(1, n, -1, head_dim)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            q, k = self.rotary(q.transpose(1, 2), k.transpose(1, 2), *ropes[layer.rope])
            keys, values = kv.update(k.to(self.kv_dtype), v.transpose(1, 2).to(self.kv_dtype))
            if blocks is not None:
                out = block_attention(q, *(b.to(q.dtype) for b in kv.buffers(span)), blocks, attn.scaling)
            else:
                keys, values = keys.to(q.dtype), values.to(q.dtype)
                seen = mask if layer.window is None else window_mask(mask, start, positions[0], layer.window)
                out, _ = sdpa_attention_forward(
                    attn, q, keys, values, seen, dropout=0.0, scaling=attn.scaling, sliding_window=None
                )
            out = run_products(layer.o, out.reshape(1, n, -1).contiguous())[0]
            x = x + (out if layer.attn_out_norm is None else layer.attn_out_norm(out))
            gate, up = run_products(layer.gate_up, layer.post_norm(x))
            down = run_products(layer.down, layer.act(gate) * up)[0]
            x = x + (down if layer.mlp_out_norm is None else layer.mlp_out_norm(down))
        return decoder.norm(x)


class NativeForward:
    """The layers through the native ops (`native_ops`): where every product computes its rows at any width as
    alone (`LayerLoop.runs`), all layers in one call (`LayerLoop.run`: the rows of one sequence, or of several in
    one step); else per layer a fused norm, the products, one call for q/k norms, rotary embedding and the cache
    write, one for attention (each row over exactly the keys it may see; a sliding window's last keys), one for the
    gated activation."""

    def __init__(
        self,
        ops: ModuleType,
        model: PreTrainedModel,
        layers: list[Layer],
        loop: LayerLoop | None,
        kv_dtype: torch.dtype,
    ) -> None:
        text = model.config
        self.ops = ops
        self.decoder = model.model
        self.layers = layers
        self.loop = loop
        self.kv_dtype = kv_dtype
        self.head_dim = head_dim_of(text)
        self.heads, self.kv_heads = text.num_attention_heads, text.num_key_value_heads
        self.rope_kinds = rope_kinds(layers)

    def tables(self, x: torch.Tensor, positions: torch.Tensor) -> Tables:
        """Per rotary kind of the layers (Gemma 3: local and global), the cos and sin tables ``[n, dim]`` of
        ``positions`` ``[1, n]``, contiguous (as the native ops take them)."""
        rotary, tables = self.decoder.rotary_emb, {}
        for kind in self.rope_kinds:
            cos, sin = rotary(x, positions) if kind is None else rotary(x, positions, kind)
            tables[kind] = (cos[0].contiguous(), sin[0].contiguous())
        return tables

    def empty_rows(self, x: torch.Tensor) -> torch.Tensor:
        """An empty ``[1, kv_heads, 0, head_dim]`` tensor of the cache's dtype: what `GrowableLayer.append_in_place`
        grows a layer's buffers like."""
        return x.new_empty(1, self.kv_heads, 0, self.head_dim, dtype=self.kv_dtype)

    def batch(
        self,
        ids: torch.Tensor,
        positions: list[int],
        buffers: list[list[tuple[torch.Tensor, torch.Tensor]]],
        visible: list[tuple[torch.Tensor, torch.Tensor]],
        starts: list[int],
        rows: list[int],
    ) -> torch.Tensor:
        """The hidden states after the final norm ``[n, hidden]`` of the rows ``ids`` ``[1, n]`` of several
        sequences through the layer loop (`LayerLoop.run`), each sequence's keys and values written to its own
        ``buffers`` (per layer)."""
        loop, decoder = self.loop, self.decoder
        assert loop is not None
        x = decoder.embed_tokens(ids)[0]
        tables = self.tables(x, torch.tensor([positions], dtype=torch.long, device=x.device))
        x = loop.run(self.ops, x, tables, buffers, visible, starts, rows)
        return decoder.norm(x[None])[0]

    def hidden(self, cache: DynamicCache, start: int, fed: FedRows) -> torch.Tensor:
        """`TorchForward.hidden` (a chain, or a tree under ``fed.mask``) through the native ops."""
        ops, decoder, layers = self.ops, self.decoder, self.layers
        n = fed.ids.shape[1]
        visible = visible_keys(start, n, fed.mask, fed.ids.device)
        x = decoder.embed_tokens(fed.ids)[0]
        ropes = self.tables(x, fed.positions)
        keys, offsets = visible
        like = self.empty_rows(x)
        if self.loop is not None and self.loop.runs(x):  # a batch of one, as `batch` runs several
            buffers = [layer.append_in_place(n, like) for layer in cache.layers]
            x = self.loop.run(ops, x, ropes, [buffers], [visible], [start], [n])
            return decoder.norm(x[None])
        windowed = {w: windowed_spans(offsets, w) for w in {layer.window for layer in layers} if w is not None}
        h = ops.rms_norm(x, *layers[0].input_weight)
        last = len(layers) - 1
        for index, (layer, kv) in enumerate(zip(layers, cache.layers, strict=True)):
            k_buf, v_buf = kv.append_in_place(n, like)
            q = ops.rope_qk_cache(
                product(layer.qkv, h), layer.q_weight, layer.k_weight, layer.qk_eps, *ropes[layer.rope],
                k_buf, v_buf, start, self.heads, self.kv_heads,
            )  # fmt: skip
            spans = offsets if layer.window is None else windowed[layer.window]
            out = product(layer.o, ops.attention(q, k_buf, v_buf, keys, spans, layer.attn.scaling))
            if layer.attn_out_weight is not None:
                out = ops.rms_norm(out, *layer.attn_out_weight)
            h = ops.add_rms_norm(x, out, *layer.post_weight)
            gate_up = product(layer.gate_up, h)
            down = product(layer.down, ops.gelu_tanh_mul(gate_up) if layer.gelu else ops.silu_mul(gate_up))
            if layer.mlp_out_weight is not None:
                down = ops.rms_norm(down, *layer.mlp_out_weight)
            if index == last:
                x = x + down
            else:
                h = ops.add_rms_norm(x, down, *layers[index + 1].input_weight)
        return decoder.norm(x[None])


def window_mask(mask: torch.Tensor | None, start: int, positions: torch.Tensor, window: int) -> torch.Tensor:
    """The boolean mask ``[1, 1, n, start + n]`` of the new rows at ``positions`` (``[n]``) over a sliding window of
    ``window`` keys (each row sees itself and the keys of the ``window - 1`` positions before it, as transformers'
    sliding masks do), within ``mask``: None (a chain's causal rows), a boolean mask, or a draft tree's additive one
    (`tree_mask`: row ``i`` sees the cache and its ancestors). A key's position is its column in the cache, and for a
    new row's column the position of that row, so a tree's window is cut by depth as plain decoding cuts it."""
    rows = positions[:, None]
    cols = torch.cat([torch.arange(start, device=positions.device), positions])[None, :]
    seen = (cols <= rows) & (cols > rows - window)  # a chain's rows: causal too, one position each
    if mask is not None:
        seen = seen & (mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] == 0)
    return seen[None, None]


def rope_kinds(layers: list[Layer]) -> list[str | None]:
    """The distinct rotary kinds of ``layers`` (`Layer.rope`), in a fixed order: the native loop's table order."""
    return sorted({layer.rope for layer in layers}, key=str)


def windowed_spans(spans: torch.Tensor, window: int) -> torch.Tensor:
    """A chain's key spans (`visible_keys`: row ``i`` sees key rows ``begin..end``, the keys being the cache
    positions in order) cut to the last ``window`` keys of each row."""
    cut = spans.clone()
    cut[:, 0] = torch.clamp(spans[:, 1] - window, min=0).maximum(spans[:, 0])
    return cut


ACTIVATIONS = {"silu": False, "gelu_pytorch_tanh": True}
"""Gated MLP activations the native ops compute: name -> whether it is GELU (its tanh form) rather than SiLU."""


def activation(config: object) -> str | None:
    """The MLP's activation (``hidden_act``, Gemma's ``hidden_activation``)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


@dataclass(frozen=True)
class Layer:
    """One decoder layer as the lean loop runs it: its attention module (for the attention call's settings), its
    norms' forwards, and its products (`packed_linear.products`); Gemma 3's norms of the attention and MLP outputs,
    its sliding window and its layer's rotary kind where it has them."""

    attn: torch.nn.Module
    input_norm: Callable[[torch.Tensor], torch.Tensor]
    post_norm: Callable[[torch.Tensor], torch.Tensor]
    """The norm before the MLP (Llama's ``post_attention_layernorm``, Gemma's ``pre_feedforward_layernorm``)."""
    q_norm: Callable[[torch.Tensor], torch.Tensor] | None
    k_norm: Callable[[torch.Tensor], torch.Tensor] | None
    act: Callable[[torch.Tensor], torch.Tensor]
    qkv: list[Product]
    o: list[Product]
    gate_up: list[Product]
    down: list[Product]
    input_weight: tuple[torch.Tensor, float]
    """The input norm's weight and epsilon (for the native ops), as is each ``*_weight`` below (Gemma's norms
    multiply by ``1 + weight``: that sum is given)."""
    post_weight: tuple[torch.Tensor, float]
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    qk_eps: float
    attn_out_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    mlp_out_norm: Callable[[torch.Tensor], torch.Tensor] | None = None
    attn_out_weight: tuple[torch.Tensor, float] | None = None
    mlp_out_weight: tuple[torch.Tensor, float] | None = None
    window: int | None = None
    """Keys a row sees (itself and those before it) in a sliding-window layer, else None."""
    rope: str | None = None
    """The rotary tables' kind (``rotary_emb``'s ``layer_type``) where the model has several, else None."""
    gelu: bool = False

    @classmethod
    def of(cls, layer: torch.nn.Module) -> Layer:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm = getattr(attn, "q_norm", None)
        gemma = hasattr(layer, "pre_feedforward_layernorm")
        pre_mlp = layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm
        window = getattr(attn, "sliding_window", None)
        return cls(
            attn=attn,
            input_norm=layer.input_layernorm.forward,
            post_norm=pre_mlp.forward,
            q_norm=None if q_norm is None else q_norm.forward,
            k_norm=None if q_norm is None else attn.k_norm.forward,
            act=mlp.act_fn,
            qkv=products([attn.q_proj, attn.k_proj, attn.v_proj]),
            o=products([attn.o_proj]),
            gate_up=products([mlp.gate_proj, mlp.up_proj]),
            down=products([mlp.down_proj]),
            input_weight=_norm_weight(layer.input_layernorm),
            post_weight=_norm_weight(pre_mlp),
            q_weight=None if q_norm is None else _norm_weight(q_norm)[0],
            k_weight=None if q_norm is None else _norm_weight(attn.k_norm)[0],
            qk_eps=1e-6 if q_norm is None else _norm_weight(q_norm)[1],
            attn_out_norm=layer.post_attention_layernorm.forward if gemma else None,
            mlp_out_norm=layer.post_feedforward_layernorm.forward if gemma else None,
            attn_out_weight=_norm_weight(layer.post_attention_layernorm) if gemma else None,
            mlp_out_weight=_norm_weight(layer.post_feedforward_layernorm) if gemma else None,
            window=int(window) if window else None,
            rope=getattr(attn, "layer_type", None) if gemma else None,
            gelu=ACTIVATIONS.get(str(activation(attn.config)), False),
        )


@dataclass(frozen=True)
class LayerLoop:
    """What the native layer loop (``decode_layers``) takes besides the rows: every layer's packed weights and
    biases (q/k/v, o, gate/up, down), norm weights and epsilons, Gemma 3's output norms, windows and rotary kinds,
    the attention's shape; and the products whose row plans must be 1 for it to run. `run` makes the one call."""

    parts: list[torch.Tensor]
    """Each product's weight, layer by layer (q/k/v, o, gate/up, down): one packed matrix each, or (with
    ``part_counts``) that many parts one after another."""
    biases: list[torch.Tensor | None]
    norms: list[torch.Tensor]
    """Each layer's input norm and pre-MLP norm weights."""
    eps: float
    qk_norms: list[torch.Tensor | None]
    """Each layer's q and k norm weights (None: none)."""
    qk_eps: float
    out_norms: list[torch.Tensor | None]
    """Gemma 3's norms of the attention and MLP outputs, two per layer (empty: none)."""
    windows: list[int]
    """Each layer's sliding window (0: none)."""
    rope_of: list[int]
    """Each layer's rotary table: an index into `rope_kinds`."""
    gelu: bool
    part_counts: list[int]
    """Each product's count of weight parts (empty: one each)."""
    heads: int
    kv_heads: int
    scaling: float
    rope_kinds: list[str | None]
    """The rotary tables' kinds (``rotary_emb``'s ``layer_type``; None: the model's one table), in table order."""
    products: list[Product]
    """One per distinct product (plan key): whose row plans decide whether the loop runs."""
    plans: dict[tuple[object, ...], RowPlan]
    """The target's row plans (``target.facts.row_plans``), which the verdicts read."""
    _verdicts: dict[tuple[torch.dtype, int], bool] = field(default_factory=dict)

    @classmethod
    def of(
        cls, layers: list[Layer], plans: dict[tuple[object, ...], RowPlan], heads: int, kv_heads: int
    ) -> LayerLoop | None:
        """The loop's operands, or None where a layer's products are not single packed matrices, its norms'
        epsilons differ or its layers mix activations (the Python loop runs those)."""
        packed, biases, norms, qk_norms, out_norms = [], [], [], [], []
        products: dict[tuple[object, ...], Product] = {}
        for layer in layers:
            for group in (layer.qkv, layer.o, layer.gate_up, layer.down):
                operands = packed_operands(group[0]) if len(group) == 1 else None
                if operands is None:
                    return None
                packed.append(operands[0])
                biases.append(operands[1])
                products.setdefault(group[0][0], group[0])
            norms += [layer.input_weight[0], layer.post_weight[0]]
            qk_norms += [layer.q_weight, layer.k_weight]
            out_norms += [None if w is None else w[0] for w in (layer.attn_out_weight, layer.mlp_out_weight)]
        outs = [w[1] for layer in layers for w in (layer.attn_out_weight, layer.mlp_out_weight) if w is not None]
        eps = {e for layer in layers for e in (layer.input_weight[1], layer.post_weight[1])} | set(outs)
        if len(eps) != 1 or len({layer.qk_eps for layer in layers}) != 1 or len({la.gelu for la in layers}) != 1:
            return None
        kinds = rope_kinds(layers)
        counts = [len(parts) for parts in packed]
        return cls(
            parts=[part for parts in packed for part in parts],
            biases=biases,
            norms=norms,
            eps=eps.pop(),
            qk_norms=qk_norms,
            qk_eps=layers[0].qk_eps,
            out_norms=out_norms if any(w is not None for w in out_norms) else [],
            windows=[layer.window or 0 for layer in layers],
            rope_of=[kinds.index(layer.rope) for layer in layers],
            gelu=layers[0].gelu,
            part_counts=counts if any(n > 1 for n in counts) else [],
            heads=heads,
            kv_heads=kv_heads,
            scaling=float(layers[0].attn.scaling),
            rope_kinds=kinds,
            products=list(products.values()),
            plans=plans,
        )

    def run(
        self,
        ops: ModuleType,
        x: torch.Tensor,
        tables: dict[str | None, tuple[torch.Tensor, torch.Tensor]],
        buffers: list[list[tuple[torch.Tensor, torch.Tensor]]],
        visible: list[tuple[torch.Tensor, torch.Tensor]],
        starts: list[int],
        rows: list[int],
    ) -> torch.Tensor:
        """Every layer over the rows ``x`` ``[n, hidden]`` of one or more sequences (``rows[s]`` consecutive rows of
        sequence ``s``, written from ``starts[s]`` to its own per-layer key/value ``buffers[s]``, each row seeing
        the keys ``visible[s]`` gives it), with the rotary ``tables`` by kind: the residual stream after the last
        layer (``x``, updated in place)."""
        layers = len(self.windows)
        return ops.decode_layers(
            x, self.parts, self.biases, self.norms, self.eps, self.qk_norms, self.qk_eps,
            [seq[layer][0] for layer in range(layers) for seq in buffers],
            [seq[layer][1] for layer in range(layers) for seq in buffers],
            [tables[kind][0] for kind in self.rope_kinds], [tables[kind][1] for kind in self.rope_kinds],
            [keys for keys, _ in visible], [spans for _, spans in visible], starts, rows,
            self.heads, self.kv_heads, self.scaling, self.out_norms, self.windows, self.rope_of, self.gelu,
            self.part_counts,
        )  # fmt: skip

    def runs(self, x: torch.Tensor) -> bool:
        """Whether every product computes its rows at any width as alone (row plan 1) at ``x``'s dtype and the
        current thread count, as the loop computes them (decided once per dtype and thread count)."""
        when = (x.dtype, torch.get_num_threads())
        verdict = self._verdicts.get(when)
        if verdict is None:
            verdict = self._verdicts[when] = all(
                decode_matched.plan_for(key, kernel, x.new_zeros(1, _in_features(key)), self.plans).base == 1
                for key, kernel, _ in self.products
            )
        return verdict


def _in_features(key: tuple[object, ...]) -> int:
    shape = key[1]
    assert isinstance(shape, tuple)
    return int(shape[1])


def _norm_weight(norm: torch.nn.Module) -> tuple[torch.Tensor, float]:
    """An RMSNorm's weight and epsilon (transformers names it ``variance_epsilon`` or ``eps``); for Gemma's norms,
    which multiply by ``1 + weight`` in float32, that sum."""
    eps = getattr(norm, "variance_epsilon", None)
    weight = norm.weight.detach()
    if type(norm).__name__.startswith("Gemma"):
        weight = (1.0 + weight.float()).to(weight.dtype)
    return weight, float(getattr(norm, "eps", 1e-6) if eps is None else eps)


def visible_keys(
    start: int, rows: int, mask: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache rows each new row attends to: key rows and each row's ``(begin, end)`` span of them. A chain's
    rows share one list (row ``i`` sees the cache and the chain up to itself: a prefix of it); a draft tree's
    ``mask`` gives each row the cache and its ancestors, one list per row."""
    if mask is None:
        ends = torch.arange(start + 1, start + rows + 1)
        spans = torch.stack([torch.zeros_like(ends), ends], dim=1)
        return torch.arange(start + rows, device=device), spans.to(device)
    cache = list(range(start))
    flat: list[int] = []
    spans_list: list[list[int]] = []
    for row in seen_rows(mask, start):
        spans_list.append([len(flat), len(flat) + start + len(row)])
        flat.extend((*cache, *(start + r for r in row)))
    return torch.tensor(flat, dtype=torch.long, device=device), torch.tensor(spans_list, device=device)


def product(group: list[Product], x: torch.Tensor) -> torch.Tensor:
    """The whole output of ``group``'s projections of ``x`` (one fused product, or the members' side by side)."""
    outputs = [decode_matched.matched_product(key, kernel, x) for key, kernel, _ in group]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


def seen_rows(mask: torch.Tensor, start: int) -> list[list[int]]:
    """Per row of a draft tree's additive mask (`tree_mask`: every row sees the ``start`` cached positions), the new
    rows it sees."""
    allowed = mask[0, 0] == 0
    if not bool(allowed[:, :start].all()):
        raise ValueError("a lean forward's tree mask must let every row see the whole cache")
    return [row.nonzero().squeeze(-1).tolist() for row in allowed[:, start:]]


def run_products(group: list[Product], x: torch.Tensor) -> list[torch.Tensor]:
    """Every projection of ``group`` applied to ``x`` (decode-matched where a matched forward runs)."""
    outputs: list[torch.Tensor] = []
    for key, kernel, splits in group:
        y = decode_matched.matched_product(key, kernel, x)
        outputs.extend(y.split(splits, dim=-1) if len(splits) > 1 else (y,))
    return outputs
