"""What a forward of ``w`` tokens costs on a target, measured once per loaded model.

The draft planner weighs the tokens a draft is expected to add against what verifying it costs. That cost is a
property of the model, its dtype, the kernels and the machine: on a CPU a few-token verification of a small model
costs well over one decode step, and how much depends on the weights' layout; on a GPU it costs almost nothing
(bench/RESULTS.md). So it is measured, not guessed: a few forwards at a handful of widths over a short scratch
context, the widths taking turns, the fastest of ``repeats`` kept per width (the least disturbed by other work),
interpolated linearly in between.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from lattice_inference.process import release_freed_memory
from lattice_inference.targets.base import Target
from lattice_inference.targets.facts import ForwardCosts

CALIBRATION_CONTEXT = 64
"""Tokens of scratch context the widths are measured after (attention over a short cache, as in a decode)."""


def calibration_widths(max_width: int) -> list[int]:
    """1, 2, 4, 8, ... up to ``max_width``, and ``max_width`` itself."""
    widths, w = [], 1
    while w < max_width:
        widths.append(w)
        w *= 2
    return [*widths, max_width]


def measure_forward_costs(
    target: Target, widths: Sequence[int], repeats: int = 3, context: int = CALIBRATION_CONTEXT
) -> ForwardCosts:
    """Time forwards of each width on ``target`` after a scratch prefill of ``context`` tokens (one untimed
    forward of the widest width first warms the kernels up), the widths taking turns within each repeat so that a
    busy moment of the machine hits them alike; the fastest of each width's ``repeats`` is kept. It runs on a
    scratch sequence of the target (released after)."""
    widths = sorted(set(widths) | {1})
    vocab = target.vocab_size
    seq = target.new_sequence(None, probe=True)
    try:
        target.prefill(seq, [(7 * i + 3) % vocab for i in range(context)])
        warm = [(11 * i + 5) % vocab for i in range(widths[-1])]
        target.forward(seq, warm)
        target.rollback(seq, context)
        best = [float("inf")] * len(widths)
        for _ in range(repeats):
            for i, w in enumerate(widths):
                start = time.perf_counter()
                target.forward(seq, warm[:w])
                best[i] = min(best[i], time.perf_counter() - start)
                target.rollback(seq, context)
    finally:
        target.release(seq)
    return ForwardCosts(tuple(widths), tuple(best))


def forward_costs(target: Target, max_width: int) -> ForwardCosts:
    """`measure_forward_costs` up to ``max_width``, once per target (kept on it: ``target.facts.costs``)."""
    known = target.facts.costs
    if known is not None and known.widths[-1] >= max_width:
        return known
    costs = target.facts.costs = measure_forward_costs(target, calibration_widths(max_width))
    release_freed_memory()  # the wide forwards' logits: a 150k vocabulary's are 40 MB at 64 rows
    return costs
