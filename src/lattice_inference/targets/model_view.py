"""A target's own view of the user's model: the same weights, its own modules and config.

A target prepares the model it runs: linear layers routed through packed weights (`packed_linear`), products and
mixture-of-experts modules routed row by row (`decode_matched`), attention switched to the decode-matched
implementation. Doing that to the model the caller passed would change the caller's model under them (its forwards,
its config's ``_attn_implementation``) and tie every target over it to one preparation. `runner_view` gives the
target a copy of the module tree instead: every module object and every config object is new, every parameter and
buffer is the caller's own tensor (no weight is copied), so the target changes its view and the caller's model
computes exactly what it did before. Two targets over one model hold one packed copy of each weight between them
(`packed_linear` keys its packings by the weight).
"""

from __future__ import annotations

import copy
from typing import TypeVar

from torch import nn
from transformers import PretrainedConfig

M = TypeVar("M", bound=nn.Module)


def runner_view(model: M) -> M:
    """A copy of ``model``'s module tree sharing its parameters and buffers (see the module docstring): new module
    objects with their own registries and hooks (copied as they stand, so hooks registered later on either side stay
    on that side), and new config objects (one copy each, shared wherever the model shares one)."""
    modules: dict[int, nn.Module] = {}
    configs: dict[int, object] = {}

    def config_copy(config: PretrainedConfig) -> PretrainedConfig:
        # one memo for every config: a sub-config reached from its parent and directly is copied once
        return copy.deepcopy(config, configs)

    def view(module: nn.Module) -> nn.Module:
        done = modules.get(id(module))
        if done is not None:
            return done
        clone = type(module).__new__(type(module))
        modules[id(module)] = clone
        state = dict(vars(module))
        for name, value in state.items():
            if isinstance(value, PretrainedConfig):
                state[name] = config_copy(value)
            elif isinstance(value, dict) and name.startswith("_"):  # registries and hooks: _parameters, _modules, ...
                state[name] = copy.copy(value)
        children = state["_modules"]
        for name, child in children.items():
            if child is not None:
                children[name] = view(child)
        vars(clone).update(state)
        return clone

    return view(model)  # type: ignore[return-value]
