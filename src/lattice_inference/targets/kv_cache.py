"""A position-indexed KV cache layer: rollback is a matter of where the next write goes.

transformers' ``DynamicLayer`` appends with ``torch.cat``, which copies the whole cache on every forward (and a
crop slices, so the next append copies again): O(context) work per decode step, a real cost for grounded tasks
with long prompts. `GrowableLayer` keeps one buffer with spare capacity (doubling when full), writes new keys and
values in place at the current length, and returns views of the filled part; ``crop`` only moves the length.
It is a drop-in for ``DynamicLayer`` inside a ``DynamicCache`` (same update/crop/get_seq_length contract).

`CacheSlots` preallocates the buffers instead, for a fixed number of sequences of a fixed length (``kv_slots``):
each sequence's layers are `GrowableLayer.over` its slot's rows, which never move.
"""

from __future__ import annotations

import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_CAPACITY = 256


def _filled_view(buffer: str, name: str) -> property:
    """`GrowableLayer`'s ``keys`` (``buffer`` ``"_k"``) or ``values`` (``"_v"``): a view of the filled part of the
    buffer, made when read (a batched step grows every layer of every sequence, and making the views there cost as
    much as the rest of its Python); what the base class assigns to ``name`` before the buffer exists is kept aside
    and read until it does."""
    aside = f"_unbuffered_{name}"

    def get(layer: GrowableLayer) -> torch.Tensor | None:
        rows = getattr(layer, buffer)
        return layer.__dict__.get(aside) if rows is None else rows[..., : layer._filled, :]

    def put(layer: GrowableLayer, value: torch.Tensor | None) -> None:
        layer.__dict__[aside] = value

    return property(get, put)


class GrowableLayer(DynamicLayer):
    """A full-attention cache layer over a preallocated buffer (see the module docstring)."""

    def __init__(self) -> None:
        self._filled = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None  # batch entry 0 of the buffers (`append_in_place`)
        self._fixed = False
        super().__init__()

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor) -> GrowableLayer:
        """A layer whose buffers are ``keys`` and ``values`` (``[1, kv_heads, rows, dim]``, a `CacheSlots` slot) for
        good: it never reallocates them (their addresses stay, as a captured graph needs), and a length past their
        rows is an error."""
        layer = cls()
        layer.lazy_initialization(keys[..., :0, :], values[..., :0, :])
        layer._k, layer._v, layer._rows, layer._fixed = keys, values, (keys[0], values[0]), True
        return layer

    keys = _filled_view("_k", "keys")
    values = _filled_view("_v", "values")

    def _reserve(self, needed: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        capacity = 0 if self._k is None else self._k.shape[-2]
        if self._k is not None and needed <= capacity:
            return
        if self._fixed:
            raise ValueError(f"a cache slot holds {capacity} positions, {needed} asked")
        size = max(needed, 2 * capacity, MIN_CAPACITY)
        # zeroed, not empty: `block_attention` reads past the length (masked, so only finiteness matters)
        new_k = keys.new_zeros((*keys.shape[:-2], size, keys.shape[-1]))
        new_v = values.new_zeros((*values.shape[:-2], size, values.shape[-1]))
        if self._filled:
            assert self._k is not None and self._v is not None
            new_k[..., : self._filled, :] = self._k[..., : self._filled, :]
            new_v[..., : self._filled, :] = self._v[..., : self._filled, :]
        self._k, self._v = new_k, new_v
        self._rows = (new_k[0], new_v[0])

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key_states``/``value_states`` at the current length; return every cached key and value."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._filled + key_states.shape[-2]
        self._reserve(end, key_states, value_states)
        assert self._k is not None and self._v is not None
        self._k[..., self._filled : end, :] = key_states
        self._v[..., self._filled : end, :] = value_states
        self._filled = end
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def buffers(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the first ``length`` rows of the key and value buffers (grown as needed), past the cache's
        length too: those rows hold zeros or stale, finite values."""
        assert self._k is not None and self._v is not None
        self._reserve(length, self._k, self._v)
        return self._k[..., :length, :], self._v[..., :length, :]

    def append_in_place(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Grow the length by ``rows`` (the buffers first, as needed) and return the whole key and value buffers of
        batch entry 0, ``[kv_heads, capacity, dim]`` (views made once per buffer: a batched step asks every layer of
        every sequence), for a caller that writes those rows itself (the native lean step). ``like`` (``[1,
        kv_heads, 0, dim]``, the cache's dtype and device) sets up an empty layer (a prefill)."""
        if self._k is None:
            self.update(like, like)
        assert self._k is not None and self._v is not None
        self._reserve(self._filled + rows, self._k, self._v)
        self._filled += rows
        assert self._rows is not None
        return self._rows

    def get_seq_length(self) -> int:
        return self._filled

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (transformers 5 convention: a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or self._k is None:
            return
        if -tokens_to_remove > self._filled:
            raise ValueError(f"cannot remove {-tokens_to_remove} tokens from a cache of {self._filled}")
        self._filled += tokens_to_remove

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep rows ``start + rows[i]`` as positions ``start + i`` (``rows`` increasing) and drop every later one."""
        if self._k is None:
            return
        end = start + len(rows)
        if start + rows[-1] >= self._filled:
            raise ValueError(f"cannot keep row {start + rows[-1]} of a cache of {self._filled}")
        index = torch.tensor([start + r for r in rows], device=self._k.device)
        with torch.inference_mode():  # the buffers were written under inference mode
            self._k[..., start:end, :] = self._k[..., index, :]
            self._v[..., start:end, :] = self._v[..., index, :]
        self._filled = end

    def reset(self) -> None:
        super().reset()
        self._filled = 0
        if not self._fixed:  # a slot's buffers stay its own
            self._k = self._v = None
            self._rows = None


class CacheSlots:
    """Preallocated keys and values for ``count`` sequences of up to ``rows`` positions each: per layer one key and
    one value tensor ``[count, kv_heads, rows, dim]``, allocated once, here. A sequence's cache takes a free slot
    (`take`: a `GrowableLayer.over` the slot's rows in every layer) and gives it back when that cache is dropped
    (released and not kept, or evicted from the kept ones). Positions are explicit (each forward writes at the
    sequence's length) and the buffers never move: what a captured GPU graph replays. Zeroed, as `GrowableLayer`'s
    own buffers are: reads past a sequence's length see finite values (a slot's earlier sequence's, or zeros)."""

    def __init__(
        self, count: int, rows: int, layers: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if count < 1 or rows < 1:
            raise ValueError(f"cache slots need a count and rows of at least 1, got {count} and {rows}")
        shape = (count, kv_heads, rows, dim)
        self.count, self.rows = count, rows
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self._free = list(range(count - 1, -1, -1))  # taken from the end: slot 0 first

    @property
    def free(self) -> int:
        """Slots no cache holds."""
        return len(self._free)

    def take(self, cache: DynamicCache) -> bool:
        """Give ``cache`` (empty) a free slot: its layers become the slot's rows of every layer, given back when
        ``cache`` is dropped. False (``cache`` unchanged) where every slot is held."""
        if not self._free:
            return False
        slot = self._free.pop()
        cache.layers = [
            GrowableLayer.over(k[slot : slot + 1], v[slot : slot + 1])
            for k, v in zip(self.keys, self.values, strict=True)
        ]
        weakref.finalize(cache, self._free.append, slot)
        return True


def use_growable_layers(cache: DynamicCache) -> DynamicCache:
    """Replace every plain ``DynamicLayer`` of ``cache`` (full attention) by a `GrowableLayer`, in place.

    Sliding-window, linear-attention and other special layers are left as they are.
    """
    cache.layers = [GrowableLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def record_past(cache: DynamicCache) -> DynamicCache:
    """Switch on ``cache``'s past recording (so conv and sliding-window layers can be cropped), keeping no
    intermediate recurrent states, in place.

    transformers 5.25 added ``recurrent_states_to_keep`` to ``activate_past_recording`` with a default of
    ``None``, which its own Gated DeltaNet forward then compares with an int (5.24 has no such field). Our
    hybrid target rolls recurrent state back itself, so it keeps none.
    """
    cache.activate_past_recording()
    for layer in cache.layers:
        if getattr(layer, "recurrent_states_to_keep", 0) is None:
            layer.recurrent_states_to_keep = 0
    return cache
