"""How much memory the prefix cache may hold: its token budget from the machine's available memory and the model's
key-value bytes per token, and whether the machine runs low while it holds kept sequences.

A fixed token budget is wrong both ways: 8192 tokens of SmolLM2 are 190 MB, so a 24 GiB machine re-prefills a
14k-token document every turn, while the same budget of a 70B model's cache would be 2.6 GB. `auto_budget` sizes it
at start from what the machine (the CPU's ``MemAvailable``, or the GPU's free memory) has left once the model is
loaded; `low_memory` says when to drop kept sequences early, whatever the budget, so that kept caches never run the
machine out of memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MEMORY_SHARE = 0.5
"""Share of the memory available after loading that kept sequences may take by default (the rest is left to the
live sequences' caches, a long prefill's activations and the rest of the machine)."""

LOW_MEMORY_SHARE = 0.1
"""Below this share of total memory available, kept sequences are dropped (least recently used first) whatever
the budget."""


@dataclass(frozen=True)
class PrefixMemory:
    """The prefix cache's budget as sized at start, for the start-up report."""

    tokens: int
    token_bytes: int
    available_bytes: int

    def line(self) -> str:
        """One line for the start-up report."""
        share = self.tokens * self.token_bytes / 2**30
        return (
            f"prefix cache: up to {self.tokens:,} tokens kept ({share:.1f} GiB, {self.token_bytes / 1024:.1f} KiB a "
            f"token, of {self.available_bytes / 2**30:.1f} GiB available)"
        )


def memory_bytes(device: torch.device) -> tuple[int, int] | None:
    """``(available, total)`` bytes of ``device``'s memory (the CPU: ``/proc/meminfo``), or None where unknown."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)
    try:
        with open("/proc/meminfo", encoding="ascii") as info:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in info if line.split()[1:]}
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in fields or "MemTotal" not in fields:
        return None
    return fields["MemAvailable"], fields["MemTotal"]


def auto_budget(token_bytes: int, device: torch.device, fallback: int) -> PrefixMemory:
    """The default budget: `MEMORY_SHARE` of the available memory in tokens of ``token_bytes`` each (``fallback``
    tokens where the available memory is unknown)."""
    found = memory_bytes(device)
    if found is None or token_bytes <= 0:
        return PrefixMemory(fallback, token_bytes, 0)
    available = found[0]
    return PrefixMemory(int(MEMORY_SHARE * available) // token_bytes, token_bytes, available)


def low_memory(device: torch.device) -> bool:
    """Whether ``device`` has less than `LOW_MEMORY_SHARE` of its memory available (False where unknown)."""
    found = memory_bytes(device)
    return found is not None and found[0] < LOW_MEMORY_SHARE * found[1]
