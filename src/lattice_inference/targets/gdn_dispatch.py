"""A process-wide patch of transformers' Gated DeltaNet (GDN) dispatch, routing one forward's GDN calls elsewhere.

transformers' GDN layers call module-level functions of their modeling module (``torch_chunk_gated_delta_rule``,
``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn``) and return only the final recurrent state. To record
the state after every position of a forward, `routed_to` replaces those names in the modeling modules for the
duration of a block with dispatchers that hand the call to a `GdnRouter` (the hybrid target's recorder). The
patch is reference-counted and thread-safe, and a context variable routes only the calls made inside the block:
other threads and other models run the original functions.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, Protocol

import torch

from lattice_inference.kernels import decode_matched

KERNEL_NAMES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
"""The delta-rule kernels of a GDN modeling module (chunked for prefill, recurrent for one-token decoding)."""
CONV_NAME = "causal_conv1d_fn"
"""The GDN layers' short causal convolution, run per new token inside decode-matched forwards."""
PATCHED_NAMES = (*KERNEL_NAMES, CONV_NAME)
"""Every name `routed_to` replaces in a modeling module."""


class GdnRouter(Protocol):
    """Where the patched kernels send the GDN calls of one forward."""

    width: int
    """Tokens fed by the forward (the new columns of each conv input)."""

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run one delta-rule call, made as transformers' GDN forward makes it; returns ``(output, final_state)``."""
        ...


def missing_names(module: ModuleType) -> list[str]:
    """The names `routed_to` must replace that ``module`` does not define (this transformers is unsupported)."""
    return [name for name in PATCHED_NAMES if not callable(getattr(module, name, None))]


_ACTIVE_ROUTER: contextvars.ContextVar[GdnRouter | None] = contextvars.ContextVar("_ACTIVE_ROUTER", default=None)
_PATCH_LOCK = threading.Lock()
_PATCH_COUNT: dict[str, int] = {}
_ORIGINALS: dict[tuple[str, str], Callable[..., Any]] = {}


def _make_dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for a GDN kernel: the active router's kernel inside `routed_to`, else ``original``."""

    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        router = _ACTIVE_ROUTER.get()
        if router is None:
            return original(*args, **kwargs)
        return router.run(args, kwargs)

    return dispatch


def _make_conv_dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for the GDN conv: inside a decode-matched routed forward of several tokens, each new column
    is computed by the call a one-token step makes (its conv history and itself, contiguous), so that the conv's
    reduction does not depend on how many tokens the forward feeds."""

    @functools.wraps(original)
    def conv(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        router = _ACTIVE_ROUTER.get()
        if router is None or router.width == 1 or not decode_matched.active():
            return original(x, *args, **kwargs)
        history = x.shape[-1] - router.width
        kept = max(history, args[0].shape[-1])  # the conv state a one-token step sees grows to the kernel width
        columns = []
        for t in range(router.width):
            seen = min(history + t, kept)
            window = x[..., history + t - seen : history + t + 1].contiguous()
            columns.append(original(window, *args, **kwargs)[..., -1:])
        return torch.cat([x.new_zeros((*x.shape[:-1], history)), *columns], dim=-1)

    return conv


@contextlib.contextmanager
def _kernels_patched(modules: Sequence[ModuleType]) -> Iterator[None]:
    """Install the dispatchers in ``modules`` for the duration of the block (reference-counted, thread-safe)."""
    with _PATCH_LOCK:
        for module in modules:
            count = _PATCH_COUNT.get(module.__name__, 0)
            if count == 0:
                for name in PATCHED_NAMES:
                    original = getattr(module, name)
                    _ORIGINALS[module.__name__, name] = original
                    make = _make_conv_dispatcher if name == CONV_NAME else _make_dispatcher
                    setattr(module, name, make(original))
            _PATCH_COUNT[module.__name__] = count + 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            for module in modules:
                count = _PATCH_COUNT[module.__name__] - 1
                _PATCH_COUNT[module.__name__] = count
                if count == 0:
                    for name in PATCHED_NAMES:
                        setattr(module, name, _ORIGINALS.pop((module.__name__, name)))


@contextlib.contextmanager
def routed_to(router: GdnRouter, modules: Sequence[ModuleType]) -> Iterator[None]:
    """Within the block, GDN calls of this context made through ``modules`` go to ``router``."""
    context = _ACTIVE_ROUTER.set(router)
    try:
        with _kernels_patched(modules):
            yield
    finally:
        _ACTIVE_ROUTER.reset(context)
