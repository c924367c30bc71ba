"""What is checked or measured on one target and kept on it while it lives (`TargetFacts`): the load-time self-check's
outcome (`Exactness`, made by `exactness`), the forward costs by width (`ForwardCosts`, measured by `forward_cost`) and
the products' row plans (`decode_matched`). Plain data, importing no target: the modules that compute the facts
import `targets.base`, which imports this one, so there is no import circle."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lattice_inference.kernels.decode_matched import RowPlan


@dataclass(frozen=True)
class Exactness:
    """The outcome of the self-check: ``exact`` when every checked width matched, else ``failures`` say where."""

    exact: bool
    widths: tuple[int, ...]
    trees: bool = False
    """Whether a draft tree was checked too."""
    batched: int = 0
    """How many sequences shared the batched forward checked too (0: none; the target does not batch)."""
    failures: tuple[str, ...] = field(default_factory=tuple)
    kernels: tuple[str, ...] = ()
    """The product kernels the checked forwards ran (``rows``, ``tiles``, ``quant-Q4_1``, ...: the row plans' kinds)."""
    cache: str = ""
    """The KV cache's dtype where it is not the model's (``float16``: `options.KV_CACHES`), else empty."""

    def line(self) -> str:
        """One line for a report."""
        span = f"widths {self.widths[0]}-{self.widths[-1]}" if self.widths else "no widths"
        checked = span + (", a draft tree" if self.trees else "")
        if self.batched:
            checked += f", {self.batched} sequences in one forward"
        if self.kernels:
            checked += f"; products: {', '.join(self.kernels)}"
        if self.cache:
            checked += f"; {self.cache} KV cache"
        if self.exact:
            return f"decode-matched verification: exact (k-token rows equal 1-token steps bitwise, {checked})"
        failures = "; ".join(self.failures)
        if self.chains_exact:
            fallback = "draft trees and shared batched forwards are off (chains of every width were exact)"
        else:
            fallback = "drafts are verified one token at a time (lossless, no faster than plain decoding)"
        return f"decode-matched verification: NOT exact ({failures}); {fallback}"

    @property
    def chains_exact(self) -> bool:
        """Whether every checked width of a chain was exact (a failure, if any, was in the draft tree or the batched
        forward, which are checked after the widths and only where those passed)."""
        return not any(f.startswith("width") for f in self.failures)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready fields."""
        return {
            "exact": self.exact,
            "widths": list(self.widths),
            "trees": self.trees,
            "batched": self.batched,
            "failures": list(self.failures),
            "kernels": list(self.kernels),
            "cache": self.cache,
        }


@dataclass(frozen=True)
class ForwardCosts:
    """Seconds per forward at measured widths (sorted, starting at 1); `seconds` interpolates between them."""

    widths: tuple[int, ...]
    measured: tuple[float, ...]

    def seconds(self, width: int) -> float:
        """Estimated seconds of a forward of ``width`` tokens (linear between and beyond measured widths)."""
        ws, ts = self.widths, self.measured
        if width <= ws[0] or len(ws) == 1:
            return ts[0]
        i = min(max(bisect.bisect_left(ws, width), 1), len(ws) - 1)
        w0, w1, t0, t1 = ws[i - 1], ws[i], ts[i - 1], ts[i]
        return t0 + (t1 - t0) * (width - w0) / (w1 - w0)

    def relative(self, width: int) -> float:
        """Cost of a ``width``-token forward in one-token forwards."""
        return self.seconds(width) / self.measured[0]

    def to_dict(self) -> dict[str, float]:
        """Width -> cost in one-token forwards, JSON-ready."""
        return {str(w): round(t / self.measured[0], 3) for w, t in zip(self.widths, self.measured, strict=True)}


@dataclass
class TargetFacts:
    """What was checked or measured on one target, computed once and kept on it while it lives: its load-time
    self-check (`exactness`), its forward costs by width (`forward_costs`) and its products' row plans
    (`decode_matched.plan_for`, keyed by kernel, shape, dtype, device type and thread count). They belong to the target,
    not to the process: two targets on different devices or dtypes never share them."""

    exactness: Exactness | None = None
    costs: ForwardCosts | None = None
    row_plans: dict[tuple[object, ...], RowPlan] = field(default_factory=dict)
