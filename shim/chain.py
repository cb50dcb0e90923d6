"""`chain`: several optimizers as the one `attach` takes.

A model may be split between optimizers: ``torch.optim.Muon`` takes only
matrices, so the rest (biases, norms, embeddings) goes to another, AdamW say.
`attach` steps one optimizer, layer by layer; `chain` makes one of several
without changing any of them: each keeps its parameters, its state, its
hyperparameters (its LR scheduler goes on scheduling them), and ``step``,
``zero_grad``, ``state_dict`` and ``load_state_dict`` go to each in turn.

    opt = gl.chain(torch.optim.Muon(matrices, lr=0.02),
                   torch.optim.AdamW(the_rest, lr=3e-4))
    with gl.attach(model, opt) as sync:
        ...                                  # opt.step(), opt.zero_grad()

How a step of some layers reaches the right optimizer: each of their parameter
groups is tagged with the optimizer's place in the chain (`CHAIN_KEY`, a key
the optimizers ignore), and `Chain.step` hands each the groups tagged its own,
whichever groups the chain holds at the time (`Sync._step_layer` gives it one
layer's parameters of each group).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import torch

from gradlane.errors import ConfigError

__all__ = ["CHAIN_KEY", "Chain", "chain"]

# The parameter-group key saying which optimizer of a chain a group is of.
CHAIN_KEY = "gradlane_chain_index"


class Chain(torch.optim.Optimizer):
    """Optimizers stepped as one (see `chain`)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ConfigError("chain needs at least one optimizer")
        for i, opt in enumerate(optimizers):
            if not isinstance(opt, torch.optim.Optimizer):
                raise ConfigError(f"chain's argument {i} is a {type(opt).__name__}, "
                                  "not a torch.optim.Optimizer")
            if isinstance(opt, Chain):
                raise ConfigError("chain the optimizers themselves, not a chain of them")
        groups = [group for opt in optimizers for group in opt.param_groups]
        # Optimizer's own set-up (hooks, step patching); its check that no parameter is in
        # two groups covers the optimizers' groups together.
        self._held: list[dict[str, Any]] | None = None  # groups to step instead of theirs
        super().__init__([{"params": group["params"]} for group in groups], {})
        self.optimizers = list(optimizers)
        self._held = None  # from now on, the optimizers' own groups (`param_groups`)
        self.state = collections.ChainMap(  # type: ignore[assignment]
            *(opt.state for opt in optimizers))

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizers' own groups, tagged (a scheduler's change is theirs, and so is a
        group added to one of them since); or those `step` was given to step."""
        if self._held is not None:
            return self._held
        if "optimizers" not in vars(self):  # Optimizer.__init__ not yet at its groups
            return []
        for i, opt in enumerate(self.optimizers):
            for group in opt.param_groups:
                group.setdefault(CHAIN_KEY, i)
        return [group for opt in self.optimizers for group in opt.param_groups]

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        if "optimizers" not in vars(self):  # Optimizer.__init__ checking the groups
            self._held = groups
            return
        # The optimizers' own again (gradlane restoring them after a step of some layers):
        # follow the optimizers from now on.
        own = [group for opt in self.optimizers for group in opt.param_groups]
        same = len(groups) == len(own) and all(a is b for a, b in zip(groups, own, strict=True))
        self._held = None if same else groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "optimizers" in vars(self):
            raise ConfigError("add the group to one of the chained optimizers: the chain "
                              "steps their groups")
        super().add_param_group(param_group)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Each optimizer's ``step`` over the groups of this chain that are its own."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        held = self.param_groups
        for i, opt in enumerate(self.optimizers):
            mine = [group for group in held if group[CHAIN_KEY] == i]
            if not mine:
                continue
            own, opt.param_groups = opt.param_groups, mine
            step = type(opt).step
            try:
                if self._held is not None and getattr(step, "hooked", False):
                    # Some layers' step (gradlane's): the optimizer's step hooks ran once
                    # at the chain's step() (`Sync._patch_optimizer`), not at each of these.
                    step.__wrapped__(opt)  # type: ignore[attr-defined]
                else:
                    opt.step()
            finally:
                opt.param_groups = own
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Each optimizer's, in the chain's order (hooks run as Optimizer's do)."""
        for pre in self._optimizer_state_dict_pre_hooks.values():
            pre(self)
        state: dict[str, Any] = {"chain": [opt.state_dict() for opt in self.optimizers]}
        for post in self._optimizer_state_dict_post_hooks.values():
            state = post(self, state) or state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre(self, state_dict) or state_dict
        saved = state_dict.get("chain")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            raise ValueError(f"not the state of a chain of {len(self.optimizers)} optimizers")
        for opt, state in zip(self.optimizers, saved, strict=True):
            opt.load_state_dict(state)
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    def __getstate__(self) -> dict[str, Any]:
        return {"optimizers": self.optimizers}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["optimizers"])  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"chain({', '.join(type(opt).__name__ for opt in self.optimizers)})"


def chain(*optimizers: torch.optim.Optimizer) -> Chain:
    """One optimizer stepping `optimizers`, each over its own parameters, for `attach`
    (which takes one): a model split between ``torch.optim.Muon`` and AdamW, say. A
    parameter may be in one of them only."""
    return Chain(list(optimizers))
