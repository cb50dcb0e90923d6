"""`chain` on its own, without attach: a closure, the state-dict hooks torch's optimizers
run, a state that is not a chain's, and what it refuses to chain."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradlane.errors import ConfigError
from gradlane.shim import chain


def _split() -> tuple[nn.Linear, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    m = nn.Linear(3, 2)
    return m, [torch.optim.SGD([m.weight], lr=0.1, momentum=0.9),
               torch.optim.AdamW([m.bias], lr=0.01)]


def _loss(m: nn.Module) -> torch.Tensor:
    return m(torch.ones(4, 3)).square().mean()


def test_a_closure_is_evaluated_once_with_gradients_and_its_loss_returned() -> None:
    m, opts = _split()
    ref, ref_opts = _split()
    calls: list[bool] = []

    def closure() -> torch.Tensor:
        calls.append(torch.is_grad_enabled())
        m.zero_grad()
        loss = _loss(m)
        loss.backward()
        return loss

    with torch.no_grad():  # as an LR finder or LBFGS-style loop may call it
        loss = chain(*opts).step(closure)
    assert calls == [True]
    _loss(ref).backward()
    for opt in ref_opts:
        opt.step()
    assert loss is not None and loss.item() == pytest.approx(_loss(_split()[0]).item())
    assert torch.equal(m.weight, ref.weight) and torch.equal(m.bias, ref.bias)


def test_state_dict_hooks_run_as_an_optimizer_s_and_their_results_are_taken() -> None:
    m, opts = _split()
    chained = chain(*opts)
    _loss(m).backward()
    chained.step()
    seen: list[str] = []
    chained.register_state_dict_pre_hook(lambda opt: seen.append("pre"))
    chained.register_state_dict_post_hook(lambda opt, state: {**state, "tag": "posted"})
    saved = chained.state_dict()
    assert seen == ["pre"] and saved["tag"] == "posted" and len(saved["chain"]) == 2

    again = chain(*_split()[1])
    # A pre-hook's state is the one loaded: here it finds the chain's under another name.
    again.register_load_state_dict_pre_hook(lambda opt, state: {"chain": state["renamed"]})
    again.register_load_state_dict_post_hook(lambda opt: seen.append("loaded"))
    again.load_state_dict({"renamed": saved["chain"]})
    assert seen == ["pre", "loaded"]
    assert again.optimizers[1].state_dict()["state"] == opts[1].state_dict()["state"]


def test_a_state_not_of_a_chain_of_as_many_is_refused() -> None:
    _, opts = _split()
    chained = chain(*opts)
    with pytest.raises(ValueError, match="^not the state of a chain of 2 optimizers"):
        chained.load_state_dict(opts[0].state_dict())
    with pytest.raises(ValueError, match="^not the state of a chain of 2 optimizers"):
        chained.load_state_dict({"chain": [opts[0].state_dict()]})


def test_what_cannot_be_chained_is_refused_and_a_chain_names_its_optimizers() -> None:
    _, opts = _split()
    with pytest.raises(ConfigError, match="^chain needs at least one optimizer"):
        chain()
    with pytest.raises(ConfigError, match="^chain the optimizers themselves, not a chain"):
        chain(chain(opts[0]), opts[1])
    assert repr(chain(*opts)) == "chain(SGD, AdamW)"
