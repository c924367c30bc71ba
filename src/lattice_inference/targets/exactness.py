"""The self-check of decode-matched verification: is a w-token forward's every row the 1-token step's, bitwise?

A decode-matched target (`Target.decode_matched`) is built so that it should be (see
`lattice_inference.kernels.decode_matched`), but kernels differ between CPUs, GPUs and library versions, so the
identity is checked on this machine, not assumed: over a scratch context, the logits of one forward of ``w``
tokens are compared with those of ``w`` one-token forwards for every width the planner may use (and one draft
tree where the target verifies trees). Where a width differs, `locate` names the first module whose output rows
differ, so the report says which operation broke the identity; generation still runs.
"""

from __future__ import annotations

import torch

from lattice_inference.process import release_freed_memory
from lattice_inference.targets.base import Segment, Target, TargetSequence
from lattice_inference.targets.facts import Exactness

CHECK_CONTEXT = 48
"""Tokens of scratch context the check runs after."""


def _tokens(count: int, vocab: int, salt: int) -> list[int]:
    return [(salt * 7919 + 104729 * i + 13) % vocab for i in range(count)]


def _first_difference(wide: torch.Tensor, rows: list[torch.Tensor]) -> tuple[int, float] | None:
    for i, row in enumerate(rows):
        if not torch.equal(wide[i], row):
            return i, float((wide[i].float() - row.float()).abs().max())
    return None


def check_exactness(target: Target, max_width: int) -> Exactness:
    """Compare forwards of widths ``2..max_width`` (and one draft tree, where offered) with one-token forwards of
    the same tokens after a scratch context, on scratch sequences of the target (released after)."""
    vocab = target.vocab_size
    context = _tokens(CHECK_CONTEXT, vocab, 1)
    sequence = _tokens(max_width, vocab, 2)
    seq = target.new_sequence(None, probe=True)
    try:
        target.prefill(seq, context)
        alone = []
        for token in sequence:
            alone.append(target.forward(seq, [token])[-1].clone())
        target.rollback(seq, CHECK_CONTEXT)
        failures = []
        widths = tuple(range(2, max_width + 1))
        for w in widths:
            wide = target.forward(seq, sequence[:w])
            target.rollback(seq, CHECK_CONTEXT)
            diff = _first_difference(wide, alone[:w])
            if diff is not None:
                where = locate(target, seq, sequence[:w])
                failures.append(f"width {w}, row {diff[0]}: max |diff| {diff[1]:.3g} in {where}")
                break
        trees = bool(target.verifies_trees) and max_width >= 3 and not failures
        if trees:
            failures += _check_tree(target, seq, sequence[: max_width // 2 + 1], alone, vocab)
    finally:
        target.release(seq)
    batched = BATCH_SEQUENCES if target.batches_sequences and max_width >= 3 and not failures else 0
    if batched:
        failures += _check_batch(target, context, sequence, alone)
    kernels = tuple(sorted({str(key[0]) for key in target.facts.row_plans}))
    return Exactness(not failures, widths, trees, batched, tuple(failures), kernels, target.kv_cache)


BATCH_SEQUENCES = 3
"""Sequences in the batched forward the self-check compares with forwards alone."""


def _check_batch(target: Target, context: list[int], sequence: list[int], alone: list[torch.Tensor]) -> list[str]:
    """One batched forward (`Target.forward_batch`) of three sequences, each over its own context: the checked
    sequence's chain of ``len(sequence) // 2`` tokens, a one-token step of a second sequence, and a draft tree (or
    a chain) of a third, against each sequence's forwards alone."""
    vocab = target.vocab_size
    others = [_tokens(CHECK_CONTEXT // 2 + 5, vocab, 3), _tokens(CHECK_CONTEXT + 7, vocab, 4)]
    steps = [sequence[:1], _tokens(4, vocab, 5)]
    parents = [-1, 0, 0, 1] if target.verifies_trees else None
    sequences = [target.new_sequence(None, probe=True) for _ in range(BATCH_SEQUENCES)]
    try:
        expected = [alone[: max(2, len(sequence) // 2)]]
        for seq, prompt, tokens in zip(sequences[1:], others, steps, strict=True):
            target.prefill(seq, prompt)
            if tokens is steps[-1] and parents is not None:
                expected.append(list(target.forward_tree(seq, tokens, parents).clone()))
            else:
                expected.append(list(target.forward(seq, tokens).clone()))
            target.rollback(seq, len(prompt))
        target.prefill(sequences[0], context)
        segments = [
            Segment(sequences[0], sequence[: len(expected[0])]),
            Segment(sequences[1], steps[0]),
            Segment(sequences[2], steps[1], parents),
        ]
        outputs = target.forward_batch(segments)
        for index, (output, rows) in enumerate(zip(outputs, expected, strict=True)):
            diff = _first_difference(output.logits, rows)
            if diff is not None:
                return [f"batched forward, sequence {index}, row {diff[0]}: max |diff| {diff[1]:.3g}"]
        return []
    finally:
        for seq in sequences:
            target.release(seq)


def _check_tree(
    target: Target, seq: TargetSequence, chain: list[int], alone: list[torch.Tensor], vocab: int
) -> list[str]:
    """One tree after ``seq``'s context: the chain, and one leaf beside each of its drafted tokens (at depth ``d``,
    path ``chain[:d] + [leaf]``), against one-token forwards along each leaf's path."""
    leaves = [(t + 1) % vocab for t in chain[1:]]
    tokens = [*chain, *leaves]
    parents = [-1, *range(len(chain) - 1), *range(len(leaves))]
    wide = target.forward_tree(seq, tokens, parents)
    target.rollback(seq, CHECK_CONTEXT)
    rows = list(alone[: len(chain)])
    for depth, leaf in enumerate(leaves):
        target.forward(seq, chain[: depth + 1])
        rows.append(target.forward(seq, [leaf])[-1].clone())
        target.rollback(seq, CHECK_CONTEXT)
    diff = _first_difference(wide, rows)
    if diff is None:
        return []
    return [f"draft tree of {len(tokens)} rows, row {diff[0]}: max |diff| {diff[1]:.3g}"]


def locate(target: Target, seq: TargetSequence, tokens: list[int]) -> str:
    """The first module (in execution order) whose output rows in a forward of ``tokens`` differ from those of
    one-token forwards of ``seq``: names the operation that breaks decode matching. Rolls back to where it
    started."""
    model = getattr(target, "model", None)
    if not isinstance(model, torch.nn.Module):
        return "the target's forward"
    start = seq.length
    names = {module: name for name, module in model.named_modules()}
    calls: list[tuple[str, torch.Tensor]] = []

    def keep(module: torch.nn.Module, args: object, output: object) -> None:
        out = output[0] if isinstance(output, tuple) and output else output
        if isinstance(out, torch.Tensor) and out.dim() >= 2 and out.shape[0] == 1:
            calls.append((names[module], out.detach().clone()))

    handles = [m.register_forward_hook(keep) for m in names if m is not model]
    try:
        target.forward(seq, tokens)
        wide, calls[:] = list(calls), []
        target.rollback(seq, start)
        singles = []
        for token in tokens:
            target.forward(seq, [token])
            singles.append(list(calls))
            calls.clear()
    finally:
        for handle in handles:
            handle.remove()
        target.rollback(seq, start)
    previous = "the embedding"
    for index, (name, out) in enumerate(wide):
        if out.shape[1] != len(tokens):
            continue
        for row, single in enumerate(singles):
            if (
                index < len(single)
                and single[index][0] == name
                and not torch.equal(out[:, row], single[index][1][:, 0])
            ):
                return f"{type(model.get_submodule(name)).__name__} ({name}) or an operation between it and {previous}"
        previous = name
    return "an operation outside the model's modules"


def exactness(target: Target, max_width: int) -> Exactness:
    """`check_exactness` up to ``max_width``, once per target (kept on it: ``target.facts.exactness``)."""
    known = target.facts.exactness
    if known is not None and (not known.exact or (known.widths[-1] if known.widths else 1) >= max_width):
        return known
    result = target.facts.exactness = check_exactness(target, max_width)
    release_freed_memory()  # its forwards' transients, back to the system
    return result
