"""Decode-matched verification: every row of a k-token forward computed bit for bit as the 1-token step computes it.

Why: speculative decoding is lossless only if the target's choice for a token is the same whether its row was
scored alone (plain decoding) or beside drafted tokens (verification). Norms, rotary embeddings, activations and
embeddings are row-wise, but a few kernels change their reduction order with the number of rows they get: on a
CPU, oneDNN's 1-row product for ``K >= 1536`` (a split reduction) differs from its 2..16-row product, MKL's dense
float32 ``F.linear`` differs at every width, and ``scaled_dot_product_attention`` over several query rows blocks
its key and softmax reductions differently from a 1-row call over a shorter cache. In bfloat16 the differences
are large enough to flip argmaxes; on GPUs, matrix kernels also change with the row count.

How, while a target's ``forward`` runs inside `matching` (never during a prefill, which plain decoding runs the
same way):

* **Linear layers** run under a `RowPlan` calibrated once per kernel, weight shape, dtype and thread count: the
  smallest row count ``base`` (1, 2, 4, 8, 16) such that for every width up to `CALIBRATED_ROWS` each output row
  equals that row computed alone, padded with zero rows to ``base`` rows. A 1-row step is then padded to ``base``
  rows too, so the step and every verification width use the same kernel class; wider inputs run in blocks of
  `CALIBRATED_ROWS`. Where no base works, rows run one at a time (exact by construction, slower).
* **Attention** (the ``lattice_sdpa`` implementation, transformers' ``sdpa`` everywhere else) scores each query
  row with the very call a 1-token step makes: that row's query over the keys it may see (a slice of the cache
  for a chain, the cache and its ancestors for a draft tree), no mask.

`check` at load time compares a w-row forward with w 1-row forwards bitwise; of the products, only our own kernels
(`ROW_EXACT_KINDS`: exact by construction, tested so) are planned without calibration.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.pytorch_utils import Conv1D

ATTENTION = "lattice_sdpa"
"""The attention implementation name decode-matched targets switch ``sdpa`` models to."""

CALIBRATED_ROWS = 16
"""Widest product a `RowPlan` is checked at; wider inputs run in blocks of this many rows."""

BASES = (1, 2, 4, 8, 16)
"""Row counts a 1-row product may be padded to, smallest first."""

Kernel = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _Forward:
    """One decode-matched forward: the target's row plans, memoised visible key columns per attention mask."""

    plans: dict[tuple[object, ...], RowPlan]
    columns: dict[int, list[slice | torch.Tensor]] = field(default_factory=dict)


_ACTIVE: contextvars.ContextVar[_Forward | None] = contextvars.ContextVar("_DECODE_MATCHED", default=None)


@contextlib.contextmanager
def matching(plans: dict[tuple[object, ...], RowPlan] | None = None) -> Iterator[None]:
    """Run the enclosed model forward decode-matched (see the module docstring), its products under the row plans
    in ``plans`` (the target's, ``target.facts.row_plans``; calibrated into it on first use; None: a fresh
    table)."""
    token = _ACTIVE.set(_Forward({} if plans is None else plans))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    """Whether a decode-matched forward is running in this context."""
    return _ACTIVE.get() is not None


# ----------------------------------------------------------------------------------------------------------------
# Linear layers


@dataclass(frozen=True)
class RowPlan:
    """How a product's rows are computed so that each equals the 1-row step's: pad to ``base`` rows below that
    (``base`` 0: one row at a time), blocks of `CALIBRATED_ROWS` above it."""

    base: int

    def apply(self, kernel: Kernel, x: torch.Tensor) -> torch.Tensor:
        """``kernel(x)`` with every row computed as planned (``x``: ``[..., rows, in]``)."""
        rows = x.reshape(-1, x.shape[-1])
        n = rows.shape[0]
        if self.base == 0:
            parts = [kernel(rows[i : i + 1]) for i in range(n)]
        elif n < self.base:
            parts = [kernel(_pad(rows, self.base))[:n]]
        elif n <= CALIBRATED_ROWS:
            parts = [kernel(rows)]
        else:
            parts = [self.apply(kernel, rows[i : i + CALIBRATED_ROWS]) for i in range(0, n, CALIBRATED_ROWS)]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _pad(rows: torch.Tensor, count: int) -> torch.Tensor:
    return torch.cat([rows, rows.new_zeros(count - rows.shape[0], rows.shape[1])])


SPREADS = (0, 4, 12, 20)
"""Calibration input sets: `CALIBRATED_ROWS` rows of normal values each, scaled by powers of two up to
2^±spread (0: unscaled)."""


def calibration_inputs(in_features: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Inputs a `RowPlan` is checked on: one set per `SPREADS` entry, normal values whose magnitudes spread as
    activations do. Several sets matter: with outputs rounded to bfloat16 a kernel that splits its reduction
    differently by row count shows it only where the float32 sums differ past the rounding, which one set of 16
    rows catches three times out of four (oneDNN's bfloat16 product over 1536 inputs on an AVX512-BF16 CPU without
    AMX, widths 2-16 against one row: with one set of normal rows it went unseen on SmolLM2's weights, and the
    target's speculative output matched plain decoding on half the prompts)."""
    generator = torch.Generator().manual_seed(0)
    sets = []
    for spread in SPREADS:
        x = torch.randn(CALIBRATED_ROWS, in_features, generator=generator)
        if spread:
            exponents = torch.randint(-spread, spread + 1, (CALIBRATED_ROWS, in_features), generator=generator)
            x = x * torch.exp2(exponents.float())
        sets.append(x.to(device=device, dtype=dtype))
    return sets


def _reproduces(kernel: Kernel, x: torch.Tensor, base: int) -> bool:
    """Whether every width ``1..len(x)`` of ``kernel`` gives the rows that padded 1-row calls give."""
    alone = torch.cat([kernel(_pad(x[i : i + 1], base))[:1] for i in range(x.shape[0])])
    return all(
        torch.equal(kernel(_pad(x[:m], base) if m < base else x[:m])[:m], alone[:m]) for m in range(1, x.shape[0] + 1)
    )


def calibrate(kernel: Kernel, in_features: int, dtype: torch.dtype, device: torch.device) -> RowPlan:
    """The `RowPlan` of ``kernel`` (a product over ``in_features`` inputs): the smallest base whose padded 1-row
    results every width up to `CALIBRATED_ROWS` reproduces bitwise on every `calibration_inputs` set, else one row
    at a time."""
    inputs = calibration_inputs(in_features, dtype, device)
    with torch.inference_mode():
        for base in BASES:
            if all(_reproduces(kernel, x, base) for x in inputs):
                return RowPlan(base)
    return RowPlan(0)


ROW_EXACT_KINDS = ("tiles", "rows", "quant-")
"""Starts of the plan-key kinds (`packed_linear.packed_kind`; ``quant-``: every format) of our own product kernels,
whose rows are alike at any width by construction: each output's sum one fixed instruction sequence per row
(`csrc/tile_linear.cpp`, `rows_linear.cpp`, `quant_linear.cpp`; their tests compare every width with 1-row calls
bitwise, and a target's load-time self-check compares whole forwards). Their plan is base 1 without calibration,
which on a 1.5B model's output layer took 4.8 s of the first decode step after a load (AMD EPYC Zen 3, 2 threads)."""


def plan_for(
    key: tuple[object, ...], kernel: Kernel, x: torch.Tensor, plans: dict[tuple[object, ...], RowPlan]
) -> RowPlan:
    """The `RowPlan` in ``plans`` (a target's) of the kernel named by ``key`` (its kind and weight shape) at ``x``'s
    dtype and device and the current thread count, calibrated into ``plans`` on first use (base 1 for
    `ROW_EXACT_KINDS`)."""
    full = (*key, x.dtype, x.device.type, torch.get_num_threads())
    plan = plans.get(full)
    if plan is None:
        exact = bool(key) and str(key[0]).startswith(ROW_EXACT_KINDS)
        plan = plans[full] = RowPlan(1) if exact else calibrate(kernel, x.shape[-1], x.dtype, x.device)
    return plan


def matched_product(key: tuple[object, ...], kernel: Kernel, x: torch.Tensor) -> torch.Tensor:
    """``kernel(x)``; inside a decode-matched forward, computed under the kernel's `RowPlan`."""
    forward = _ACTIVE.get()
    if forward is None:
        return kernel(x)
    return plan_for(key, kernel, x, forward.plans).apply(kernel, x)


def linear_key(kind: str, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[object, ...]:
    """The plan key of a product over ``weight`` (``[out, in]``) run by kernel ``kind``."""
    return (kind, tuple(weight.shape), bias is not None)


Product = tuple[tuple[object, ...], Kernel, list[int]]
"""A product as a caller may run it: its plan key (`linear_key`), its kernel, and how its output splits among
the projections it computes."""

PRODUCT = "_lattice_product"
"""Attribute of an ``nn.Linear`` holding its `Product` (set where its weight is packed, else on first use)."""

_MATCHED = "_lattice_decode_matched"


def module_product(module: nn.Linear) -> Product:
    """``module``'s `Product`: the one set where its weight was packed, else ``F.linear`` over its dense weight
    (built once, kept on the module)."""
    product = getattr(module, PRODUCT, None)
    if product is None:
        kernel = functools.partial(nn.functional.linear, weight=module.weight, bias=module.bias)
        product = (linear_key("dense", module.weight, module.bias), kernel, [module.out_features])
        setattr(module, PRODUCT, product)
    return product


def plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` computing ``F.linear`` as the class does: not a subclass with a forward
    of its own (a router returning scores and indices, say), whose forward may not be replaced by a product."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _dense_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    key, kernel, _ = module_product(module)
    return matched_product(key, kernel, x)


def _addmm(x: torch.Tensor, *, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``Conv1D``'s own computation: ``addmm`` over ``x``'s rows flattened, reshaped back."""
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight).reshape(*x.shape[:-1], weight.shape[-1])


def _conv1d_forward(module: Conv1D, x: torch.Tensor) -> torch.Tensor:
    """transformers' ``Conv1D`` (GPT-2's products: ``x @ weight + bias``, weight ``[in, out]``) as a matched
    product."""
    product = getattr(module, PRODUCT, None)
    if product is None:
        kernel = functools.partial(_addmm, weight=module.weight, bias=module.bias)
        product = (("conv1d", tuple(module.weight.shape), True), kernel, [module.nf])
        setattr(module, PRODUCT, product)
    key, kernel, _ = product
    return matched_product(key, kernel, x)


def match_dense_linears(model: nn.Module) -> int:
    """Route every ``nn.Linear`` of ``model`` whose forward is still the class's own (not packed), and every
    transformers ``Conv1D`` (GPT-2's family), through `matched_product`; returns how many were routed
    (idempotent)."""
    count = 0
    for module in model.modules():
        if "forward" in vars(module):
            continue
        if plain_linear(module):
            module.forward = functools.partial(_dense_forward, module)
        elif type(module) is Conv1D:
            module.forward = functools.partial(_conv1d_forward, module)
        else:
            continue
        setattr(module, _MATCHED, True)
        count += 1
    return count


ROW_WISE_SUFFIXES = ("Experts", "TopKRouter")
"""Class-name endings of modules whose products run over a varying number of rows in plain tensors (mixture-of-
experts layers in transformers 5: a router's ``F.linear``, each expert's products over the tokens routed to it);
inside a decode-matched forward they run one token at a time, as in a 1-token step. So do the module that holds an
``...Experts`` module (the sparse block, where it is not the decoder layer itself: its routing and experts together,
whatever shapes it hands them, as Llama 4's repeated rows per expert) and ``nn.Linear`` subclasses with a forward of
their own (`plain_linear` false: routers such as Llama 4's)."""

_IN_ROW: contextvars.ContextVar[bool] = contextvars.ContextVar("_DECODE_MATCHED_ROW", default=False)
"""Whether a row-wise module is running one token now (modules inside it then run as they are)."""


def _token_dim(tensor: torch.Tensor) -> int:
    """The token dimension of a module's input or output: 1 for ``[batch, tokens, hidden]``, else 0."""
    return 1 if tensor.dim() == 3 else 0


def _joined(rows: list[object]) -> object:
    """One token's outputs joined back along their token dimension (tuples part by part; other values: the
    first's)."""
    first = rows[0]
    if isinstance(first, tuple):
        return tuple(_joined(list(parts)) for parts in zip(*rows, strict=True))
    if isinstance(first, torch.Tensor):
        return torch.cat(rows, dim=_token_dim(first))
    return first


def _row_wise_forward(module: nn.Module, original: Callable[..., object], *args: object, **kwargs: object) -> object:
    """``module``'s forward, one token at a time inside a decode-matched forward; the row-wise modules inside it
    then run as they are (each sees what a 1-token step hands it)."""
    if _ACTIVE.get() is None or _IN_ROW.get():
        return original(*args, **kwargs)
    token = _IN_ROW.set(True)
    try:
        return _one_token_at_a_time(original, args, kwargs)
    finally:
        _IN_ROW.reset(token)


def _one_token_at_a_time(
    original: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
) -> object:
    first = args[0] if args else next(iter(kwargs.values()), None)
    if not isinstance(first, torch.Tensor) or first.dim() < 2:
        return original(*args, **kwargs)
    dim = _token_dim(first)
    n = first.shape[dim]
    sizes = any(isinstance(a, list | tuple) and a and all(isinstance(x, int) for x in a) for a in args)
    if n < 2 or sizes:  # one row, or rows grouped by sizes given beside them (JetMoE's experts): not sliceable
        return original(*args, **kwargs)

    def part(value: object, i: int) -> object:
        if isinstance(value, torch.Tensor) and value.dim() == first.dim() and value.shape[dim] == n:
            return value.narrow(dim, i, 1)
        return value

    return _joined(
        [original(*(part(a, i) for a in args), **{k: part(v, i) for k, v in kwargs.items()}) for i in range(n)]
    )


def match_row_wise_modules(model: nn.Module) -> int:
    """Route the mixture-of-experts modules of ``model`` (`ROW_WISE_SUFFIXES`) one token at a time inside
    decode-matched forwards; returns how many (idempotent)."""
    chosen: dict[int, nn.Module] = {}
    for module in model.modules():
        named = type(module).__name__.endswith(ROW_WISE_SUFFIXES)
        if named or (isinstance(module, nn.Linear) and not plain_linear(module)):
            chosen[id(module)] = module
        for child in module.children():
            if type(child).__name__.endswith("Experts") and not type(module).__name__.endswith("Layer"):
                chosen[id(module)] = module
    count = 0
    for module in chosen.values():
        if not hasattr(module, _MATCHED):
            module.forward = functools.partial(_row_wise_forward, module, module.forward)
            setattr(module, _MATCHED, True)
            count += 1
    return count


# ----------------------------------------------------------------------------------------------------------------
# Attention


def _visible(mask: torch.Tensor | None, rows: int, keys: int) -> list[slice | torch.Tensor]:
    """Per query row, the key columns it attends to: a slice where they are contiguous, else their indices."""
    if mask is None:  # causal, the rows being the last ``rows`` of the ``keys`` positions
        return [slice(0, keys - rows + i + 1) for i in range(rows)]
    allowed = mask[0, 0] if mask.dtype == torch.bool else mask[0, 0] > torch.finfo(mask.dtype).min / 2
    allowed = allowed.expand(rows, keys)
    counts = allowed.sum(-1).tolist()
    firsts = allowed.to(torch.int8).argmax(-1).tolist()
    columns: list[slice | torch.Tensor] = []
    for i, (first, count) in enumerate(zip(firsts, counts, strict=True)):
        if bool(allowed[i, first : first + count].all()):
            columns.append(slice(first, first + count))
        else:
            columns.append(allowed[i].nonzero().squeeze(-1))
    return columns


def _is_bias(mask: torch.Tensor | None) -> bool:
    """Whether ``mask`` adds values of the model's own to the scores it lets through (not only 0 or the dtype's
    minimum, as a causal or padding mask does)."""
    if mask is None or not mask.is_floating_point():
        return False
    return bool(((mask != 0) & (mask > torch.finfo(mask.dtype).min / 2)).any())


def decode_matched_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention; inside a decode-matched forward, each query row of a multi-row call runs
    as a 1-token step's call: its query over exactly the keys it may see, without a mask (or with its row of a
    mask that carries a bias, `_is_bias`)."""
    if _ACTIVE.get() is None or query.shape[2] == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    window = kwargs.get("sliding_window")
    biased = _is_bias(attention_mask)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, row_mask: torch.Tensor | None) -> torch.Tensor:
        # A 1-token step gets no mask, except over a full sliding window (transformers' sdpa_mask keeps it there),
        # or where the model adds a bias of its own to the scores (Doge's dynamic mask): that row's bias.
        seen = k.shape[2]
        if biased:
            assert row_mask is not None
            mask: torch.Tensor | None = row_mask.contiguous()
        elif window is None or seen < window:
            mask = None
        else:
            mask = key.new_ones((1, 1, 1, seen), dtype=torch.bool)
        return sdpa_attention_forward(module, q, k, v, mask, **kwargs)[0]

    return _by_rows(step, query, key, value, attention_mask), None


EAGER = "eager_attention_forward"
"""The name under which a transformers modeling module defines its own eager attention (what ``eager`` models call)."""


def _by_rows(
    step: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of each query row as a 1-token step: ``step(its query, the keys and values it sees, its row of the
    mask)`` per row (`_row_keys`), the outputs joined along the rows."""
    rows = query.shape[2]
    outputs = [
        step(query[:, :, i : i + 1], k, v, mask)
        for i, (k, v, mask) in enumerate(_row_keys(key, value, attention_mask, rows))
    ]
    return torch.cat(outputs, dim=1)


def _row_keys(
    key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None, rows: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Per query row of a decode-matched forward: the keys and values it sees and its row of ``attention_mask`` over
    them (None without a mask); the visible columns memoised per mask for the forward."""
    forward = _ACTIVE.get()
    assert forward is not None
    memo = id(attention_mask)
    columns = forward.columns.get(memo)
    if columns is None:
        columns = forward.columns[memo] = _visible(attention_mask, rows, key.shape[2])
    for i, cols in enumerate(columns):
        if isinstance(cols, slice):
            k, v = key[:, :, cols], value[:, :, cols]
        else:
            k, v = key.index_select(2, cols), value.index_select(2, cols)
        if attention_mask is None:
            yield k, v, None
            continue
        row = attention_mask[:, :, i : i + 1]
        yield k, v, (row[..., cols] if isinstance(cols, slice) else row.index_select(3, cols))


def _eager_matched(original: Callable[..., tuple[torch.Tensor, object]]) -> Callable[..., tuple[torch.Tensor, object]]:
    """A modeling module's eager attention; inside a decode-matched forward each query row of a multi-row call runs
    as the 1-token step's call: its query over the keys it sees, with its row of the mask (zeros where a step's
    mask has zeros; a bias where the model adds one), through the model's own eager code (soft-capping, sinks)."""

    @functools.wraps(original)
    def eager(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: object,
        **kwargs: object,
    ) -> tuple[torch.Tensor, object]:
        if _ACTIVE.get() is None or query.shape[2] == 1:
            return original(module, query, key, value, attention_mask, *args, **kwargs)

        def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
            return original(module, q, k, v, mask, *args, **kwargs)[0]

        return _by_rows(step, query, key, value, attention_mask), None

    setattr(eager, _MATCHED, True)
    return eager


def _match_eager(model: nn.Module) -> bool:
    """Route the eager attention of ``model``'s modeling modules (`EAGER`) row by row inside decode-matched forwards
    (outside them it runs as it was, for every model of those modules). True where one was found."""
    import sys

    found = False
    for module in model.modules():
        owner = sys.modules.get(type(module).__module__)
        eager = getattr(owner, EAGER, None)
        if owner is None or not callable(eager):
            continue
        if not getattr(eager, _MATCHED, False):
            setattr(owner, EAGER, _eager_matched(eager))
        found = True
    return found


@functools.cache
def _register_attention() -> None:
    """Make `ATTENTION` known to transformers (its attention and mask functions), once, when a model first takes it:
    importing this module changes nothing in transformers."""
    AttentionInterface.register(ATTENTION, decode_matched_sdpa)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def match_attention(model: nn.Module) -> bool:
    """Switch ``model`` (a target's view: `model_view.runner_view`) from ``sdpa`` attention to `ATTENTION` (the same
    outside decode-matched forwards), or route an ``eager`` model's own eager attention row by row (`_match_eager`);
    returns whether its attention is now decode-matched (models on other implementations are left as they are)."""
    _register_attention()
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values()
    current = {getattr(c, "_attn_implementation", None) for c in configs} - {None}
    if current and current <= {ATTENTION}:
        return True
    if current == {"eager"}:
        return _match_eager(model)
    if current != {"sdpa"}:
        return False
    for config in configs:
        if getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation = ATTENTION
    return True
