"""`attach` in one process (world size 1): the hooks, per-layer steps and
fallbacks must give exactly what plain PyTorch gives.

With one worker the average of a gradient is the gradient itself (times a
weight of exactly 1.0), so every result here must be bit-identical to the
same loop without the shim: any difference is the shim changing the math.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import io
import itertools
import math
import os
import pickle
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

import gradlane.shim as gl
import gradlane.shim.ddp as ddp_module
import gradlane.shim.engine as engine_module
import gradlane.shim.sync as sync_module
from gradlane.errors import ConfigError, PeerLost, TransportError
from gradlane.policies.chunks import MIN_GROUP_BYTES, layout_sizes
from gradlane.shim.transport import Mesh, local_address
from tests import examples
from tests.ranks import on_every_rank


def model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5),
        nn.ReLU(),
        nn.Linear(5, 3),
    ).to(dtype)


def data(step: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 3, 8, 8, generator=g).to(dtype), torch.randint(0, 3, (6,), generator=g)


def attach(m: nn.Module, opt: torch.optim.Optimizer, **options: Any) -> gl.Sync:
    return gl.attach(
        m,
        opt,
        rank=0,
        world_size=1,
        store=dist.HashStore(),
        address="127.0.0.1",
        daemon_socket="/nonexistent/gl.sock",
        **options,
    )


Loop = Callable[[nn.Module, torch.optim.Optimizer, Any, int], None]


def plain_step(m: nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int) -> None:
    x, y = data(step, next(m.parameters()).dtype)
    nn.functional.cross_entropy(m(x), y).backward()
    opt.step()
    if sched is not None:
        sched.step()
    opt.zero_grad()


def twins(make_opt: Callable[[Any], torch.optim.Optimizer] = lambda p: torch.optim.SGD(
        p, lr=0.01, momentum=0.9)) -> tuple[nn.Module, torch.optim.Optimizer,
                                           nn.Module, torch.optim.Optimizer]:
    """Two copies of `model` and an optimizer each: (reference, its optimizer, the one to
    attach, its optimizer)."""
    ref, mine = model(), model()
    return ref, make_opt(ref.parameters()), mine, make_opt(mine.parameters())


def compare(
    make_opt: Callable[[Any], torch.optim.Optimizer],
    loop: Loop = plain_step,
    steps: int = 6,
    sched: Callable[[Any], Any] | None = None,
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> None:
    ref, mine = model(dtype), model(dtype)
    for m, shimmed in ((ref, False), (mine, True)):
        opt = make_opt(m.parameters())
        scheduler = sched(opt) if sched else None
        sync = attach(m, opt, **options) if shimmed else None
        for step in range(steps):
            loop(m, opt, scheduler, step)
        if sync is not None:
            sync.close()
    for (name, a), b in zip(ref.state_dict().items(), mine.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("name", ["SGD", "AdamW", "RMSprop", "Adagrad", "NAdam"])
def test_per_layer_steps_match_plain_pytorch_exactly(name: str, overlap: bool) -> None:
    kwargs = {"lr": 0.01, "momentum": 0.9} if name in ("SGD", "RMSprop") else {"lr": 0.01}
    compare(lambda p: getattr(torch.optim, name)(p, **kwargs), overlap=overlap)


# Dynamo's own, when it takes the activations handed from one graph to the next.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("overlap", [True, False])
def test_a_compiled_model_trains_exactly_as_plain_pytorch(overlap: bool) -> None:
    """`torch.compile` keeps the per-module hooks the per-layer steps hang on (each one
    breaks the graph); "aot_eager" runs the same kernels as eager, so bit for bit.
    Without overlap nothing gates, and the hooks go once the layout is fixed."""
    ref, mine = model(), model()
    compiled = torch.compile(mine, backend="aot_eager")
    opt = torch.optim.SGD(compiled.parameters(), lr=0.01, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    with attach(compiled, opt, overlap=overlap):
        for step in range(4):
            plain_step(compiled, opt, None, step)
            plain_step(ref, ref_opt, None, step)
            gated = [m for m in mine.modules() if m is not mine and m._forward_pre_hooks]
            assert bool(gated) == overlap
    for (name, a), b in zip(ref.state_dict().items(), mine.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


class Normalized(nn.Module):
    """BatchNorm (whose batch count is a 0-dim buffer) and a 0-dim parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.norm = model(), nn.BatchNorm1d(3)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.net(x)) * self.scale  # type: ignore[no-any-return]


def test_a_model_with_batchnorm_and_a_scalar_parameter_trains_as_plain_pytorch() -> None:
    """attach copied rank 0's state as bytes, and a 0-dim tensor had none to view: every
    model with BatchNorm failed at attach."""
    ref, mine = Normalized(), Normalized()
    ref_opt, opt = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (ref, mine))
    with attach(mine, opt, overlap=True):
        for step in range(3):
            plain_step(ref, ref_opt, None, step)
            plain_step(mine, opt, None, step)
    assert_same_checkpoint(checkpoint(ref, ref_opt), checkpoint(mine, opt))


class AsksItsDtype(nn.Module):
    """A model whose forward reads its parameters' dtype, as Hugging Face models do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(next(self.parameters()).dtype))  # type: ignore[no-any-return]


# Dynamo's own, when it takes the activations handed from one graph to the next.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_model_compiled_after_attach_that_reads_its_parameters_trains_as_plain_pytorch(
        ) -> None:
    """The update a parameter read applies runs as plain Python inside a compiled
    forward, as the gates do: compiled, it recompiled once per parameter (here past the
    limit of 2 set below, which then fails)."""
    ref, mine = AsksItsDtype(), AsksItsDtype()
    ref_opt, opt = (torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (ref, mine))
    with (torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True),
          attach(mine, opt, overlap=True)):
        compiled = torch.compile(mine, backend="aot_eager")
        for step in range(4):
            plain_step(ref, ref_opt, None, step)
            plain_step(compiled, opt, None, step)
    torch._dynamo.reset()
    for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_process_alone_trains_as_plain_pytorch_without_torchrun(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``python train.py`` with ``attach(..., rank=0, world_size=1)``: no rendezvous to
    set up (no MASTER_PORT), and the model trains exactly as without gradlane."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    ref, ref_opt, mine, opt = twins()
    with gl.attach(mine, opt, rank=0, world_size=1, daemon_socket="/nonexistent/gl.sock"):
        for step in range(3):
            plain_step(mine, opt, None, step)
            plain_step(ref, ref_opt, None, step)
    for (name, a), b in zip(ref.state_dict().items(), mine.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def checkpoint(m: nn.Module, opt: torch.optim.Optimizer, optimizer_first: bool = False
               ) -> dict[str, Any]:
    """Copies of both states, each taken the moment its ``state_dict()`` returns."""
    if optimizer_first:
        saved = {"opt": copy.deepcopy(opt.state_dict())}
        return {"model": copy.deepcopy(m.state_dict()), **saved}
    saved = {"model": copy.deepcopy(m.state_dict())}
    return {**saved, "opt": copy.deepcopy(opt.state_dict())}


def assert_same_checkpoint(a: dict[str, Any], b: dict[str, Any]) -> None:
    for (name, x), y in zip(a["model"].items(), b["model"].values(), strict=True):
        assert torch.equal(x, y), name
    states = a["opt"]["state"], b["opt"]["state"]
    assert states[0].keys() == states[1].keys()
    for i, per_param in states[0].items():
        for key, x in per_param.items():
            assert torch.equal(x, states[1][i][key]), (i, key)


def test_a_checkpoint_right_after_step_holds_the_step() -> None:
    """``optimizer.step()`` returns before the layers are updated (they update as their
    averages arrive); ``state_dict()`` of the model or the optimizer applies them first,
    so a checkpoint saved without ``flush()`` is the one plain PyTorch saves."""
    ref, ref_opt, mine, opt = twins(lambda p: torch.optim.AdamW(p, lr=0.01))
    with attach(mine, opt, overlap=True) as sync:
        for step in range(3):
            plain_step(ref, ref_opt, None, step)
            plain_step(mine, opt, None, step)
            assert sync.layerwise and sync._pending is not None  # the step is still pending
            mine_saved = checkpoint(mine, opt, optimizer_first=bool(step % 2))
            assert_same_checkpoint(checkpoint(ref, ref_opt), mine_saved)


def test_an_evaluation_right_after_step_sees_the_updated_model() -> None:
    ref, ref_opt, mine, opt = twins()
    with attach(mine, opt, overlap=True):
        for step in range(3):
            plain_step(ref, ref_opt, None, step)
            plain_step(mine, opt, None, step)
            x, _ = data(100 + step)
            ref.eval(), mine.eval()
            no_grad = torch.inference_mode() if step % 2 else torch.no_grad()
            with no_grad:
                assert torch.equal(ref(x), mine(x))
            ref.train(), mine.train()


def test_an_average_of_the_weights_kept_after_each_step_is_plain_pytorchs() -> None:
    """An EMA updated right after ``optimizer.step()`` reads the weights through
    ``parameters()``, which hands each one out with the step applied: torch's
    ``AveragedModel`` (started mid-training from a deep copy of the attached model) and
    one kept by hand average exactly what they average without gradlane."""
    ref, ref_opt, mine, opt = twins()
    kept: dict[nn.Module, tuple[AveragedModel, list[torch.Tensor]]] = {}
    with attach(mine, opt, overlap=True) as sync:
        for step in range(4):
            for m, o in ((ref, ref_opt), (mine, opt)):
                x, y = data(step)
                nn.functional.cross_entropy(m(x), y).backward()
                o.step()
                assert m is ref or sync._pending is not None  # not applied yet
                if step == 1:
                    kept[m] = (AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)),
                               [p.detach().clone() for p in m.parameters()])
                if step >= 1:
                    ema, by_hand = kept[m]
                    ema.update_parameters(m)
                    for average, p in zip(by_hand, m.parameters(), strict=True):
                        average.mul_(0.9).add_(p.detach(), alpha=0.1)
                o.zero_grad()
    (ref_ema, ref_by_hand), (ema, by_hand) = kept[ref], kept[mine]
    for a, b in zip(ref_ema.state_dict().values(), ema.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(ref_by_hand, by_hand, strict=True):
        assert torch.equal(a, b)


def test_the_optimizers_step_hooks_run_once_at_each_step_as_in_plain_pytorch() -> None:
    """Hooks registered on the optimizer run around each ``step()``, once, as without
    gradlane; a post-step hook keeping an average of the weights reads them updated
    (through ``parameters()``). They ran at each per-layer step instead, after the next
    forward began."""
    ref, ref_opt, mine, opt = twins()
    calls: list[str] = []
    kept: dict[nn.Module, list[torch.Tensor]] = {}

    def average(m: nn.Module) -> Callable[..., None]:
        def post(*_: Any) -> None:
            calls.append("post")
            if m not in kept:
                kept[m] = [p.detach().clone() for p in m.parameters()]
            for average, p in zip(kept[m], m.parameters(), strict=True):
                average.mul_(0.9).add_(p.detach(), alpha=0.1)
        return post

    for m, o in ((ref, ref_opt), (mine, opt)):
        o.register_step_pre_hook(lambda *_: calls.append("pre"))
        o.register_step_post_hook(average(m))
    with attach(mine, opt, overlap=True):
        for step in range(3):
            for m, o in ((ref, ref_opt), (mine, opt)):
                if step == 1:  # a resume: `__setstate__` wraps an unhooked step again
                    o.load_state_dict(o.state_dict())
                x, y = data(step)
                nn.functional.cross_entropy(m(x), y).backward()
                o.step()
                assert calls == ["pre", "post"]
                calls.clear()
                o.zero_grad()
    assert not calls
    for a, b in zip(kept[ref], kept[mine], strict=True):
        assert torch.equal(a, b)


@contextlib.contextmanager
def _handed_over(sync: gl.Sync) -> Iterator[list[int]]:
    """The ids of the groups `sync` hands its engine, in order, while within."""
    handed: list[int] = []
    ready = sync.engine.ready
    with mock.patch.object(sync.engine, "ready",
                           side_effect=lambda g: (handed.append(g.gid), ready(g))):
        yield handed


def test_a_group_goes_to_the_engine_as_its_last_gradient_comes_in_the_backward() -> None:
    """Overlap with the backward: a group is handed over as soon as all its gradients
    are in, last layer's first, not when the backward ends. When the gradient reaches
    the first layer's output, every group but the first layer's has gone."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    at_first_layer: list[list[int]] = []
    with attach(m, opt, overlap=True) as sync, _handed_over(sync) as handed:
        for step in range(3):  # the first lays out the groups
            handed.clear()
            at_first_layer.clear()
            x, y = data(step)
            h = m[0](x)
            h.register_hook(lambda _: at_first_layer.append(list(handed)))
            nn.functional.cross_entropy(m[1:](h), y).backward()
            opt.step()
            opt.zero_grad()
            (first,) = (g.gid for g in sync._groups
                        if any(p is m[0].weight for p in sync._members[g.gid]))
            assert len(sync._groups) >= 2
            assert handed == sorted((g.gid for g in sync._groups), reverse=True)
            assert at_first_layer == [[gid for gid in handed if gid != first]]


def test_groups_the_backward_did_not_reach_go_as_it_ends_not_at_the_step() -> None:
    """`b` never runs: its group is handed over as the backward ends (`_queue_end`), so
    its exchange overlaps whatever comes before the step, as the others' do."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(self.a(x))  # b never runs

    m = Branchy()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with attach(m, opt, overlap=True) as sync, _handed_over(sync) as handed:
        for _ in range(3):
            handed.clear()
            m(torch.ones(2, 4)).sum().backward()
            assert sorted(handed) == sorted(g.gid for g in sync._groups)
            opt.step()
            opt.zero_grad()


def test_the_models_zero_grad_after_step_leaves_the_update_to_the_next_forward() -> None:
    """``model.zero_grad()`` and ``model.requires_grad_()`` (a GAN freezing its
    discriminator after its step) walk ``model.parameters()`` but read no weight: the
    step stays pending, to overlap the next forward, which applies it."""
    ref, ref_opt, mine, opt = twins()
    weights = list(mine.parameters())  # read directly, not through the model
    with attach(mine, opt, overlap=True) as sync:
        for step in range(3):
            for m, o in ((ref, ref_opt), (mine, opt)):
                x, y = data(step)
                nn.functional.cross_entropy(m(x), y).backward()
                before = [w.detach().clone() for w in weights]  # the last step applied
                o.step()
                m.zero_grad()
                m.requires_grad_(False)
                m.requires_grad_(True)
            assert sync._pending is not None
            assert all(torch.equal(w, b) for w, b in zip(weights, before, strict=True))
            assert all(w.grad is None for w in weights)
    for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_copy_or_pickle_of_the_attached_model_is_the_model_without_gradlane() -> None:
    """``copy.deepcopy`` (how an EMA starts) and ``torch.save`` of the optimizer and the
    model while a step is pending: their own classes, the step applied, none of the
    shim's hooks, the optimizer still holding the model's parameters (a copy of the
    optimizer alone holds the step too). The copies train
    on their own (a copy of one module too) and leave the attached model alone."""
    ref, ref_opt, mine, opt = twins()
    with attach(mine, opt, overlap=True) as sync:
        for step in range(4):
            plain_step(ref, ref_opt, None, step)
            plain_step(mine, opt, None, step)
            assert sync._pending is not None
            if step == 1:
                copied = copy.deepcopy(mine)
                copied_opt = torch.optim.SGD(copied.parameters(), lr=0.5)
            elif step == 2:
                buffer = io.BytesIO()
                torch.save({"optimizer": opt, "model": mine}, buffer)
                buffer.seek(0)
                saved = torch.load(buffer, weights_only=False)
                copied, copied_opt = saved["model"], saved["optimizer"]
                assert type(copied_opt) is torch.optim.SGD
                held = copied_opt.param_groups[0]["params"]
                assert all(a is b for a, b in zip(held, copied.parameters(), strict=True))
                assert_same_checkpoint(checkpoint(ref, ref_opt),
                                       checkpoint(copied, copied_opt))
            else:  # the optimizer alone
                alone = copy.deepcopy(opt)
                assert type(alone) is torch.optim.SGD
                assert_same_checkpoint({"model": {}, "opt": ref_opt.state_dict()},
                                       {"model": {}, "opt": alone.state_dict()})
                continue
            assert type(copied) is nn.Sequential
            assert not any(hooks for module in copied.modules()
                           for key, hooks in vars(module).items() if key.endswith("hooks"))
            for a, b in zip(ref.parameters(), copied.parameters(), strict=True):
                assert torch.equal(a, b)
            plain_step(copied, copied_opt, None, 7)
            copied.zero_grad()
        copy.deepcopy(mine[3])(torch.ones(2, 4 * 6 * 6)).sum().backward()
    for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_pickle_of_the_attached_model_and_optimizer_is_theirs_in_every_protocol() -> None:
    """Protocols 0 and 1 rebuild an object through its class as `copyreg` names it: the
    optimizer's, not gradlane's subclass (which pickle refused, a different class of the
    same name)."""
    ref, ref_opt, mine, opt = twins()
    with attach(mine, opt, overlap=True):
        plain_step(ref, ref_opt, None, 0)
        plain_step(mine, opt, None, 0)
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            model, optimizer = pickle.loads(pickle.dumps((mine, opt), protocol=protocol))
            assert (type(model), type(optimizer)) == (nn.Sequential, torch.optim.SGD), protocol
            held = optimizer.param_groups[0]["params"]
            assert all(a is b for a, b in zip(held, model.parameters(), strict=True))
            assert_same_checkpoint(checkpoint(ref, ref_opt), checkpoint(model, optimizer))


class Checkpointed(nn.Module):
    """`model`, its last layers or all of it under ``torch.utils.checkpoint`` with
    ``use_reentrant=True``, which runs each segment's backward inside the outer one."""

    def __init__(self, segment: str) -> None:
        super().__init__()
        self.net, self.segment = model(), segment

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_()  # a reentrant segment needs an input that requires grad
        if self.segment == "all":
            return activation_checkpoint(self.net, x, use_reentrant=True)  # type: ignore[no-any-return]
        return activation_checkpoint(  # type: ignore[no-any-return]
            self.net[3:], self.net[:3](x), use_reentrant=True)


@pytest.mark.parametrize("segment", ["last", "all"])
def test_reentrant_activation_checkpointing_trains_as_plain_pytorch(segment: str) -> None:
    """The step's backward ends with the outermost backward, not with the first segment's
    inside it (there, the layers still to come were sent as unused and their gradients
    then refused as a second backward); one all inside segments ends at the step. A
    second backward without the step is still refused."""
    ref, mine = Checkpointed(segment), Checkpointed(segment)
    ref_opt, opt = (torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (ref, mine))
    with attach(mine, opt, overlap=True):
        for step in range(4):
            plain_step(ref, ref_opt, None, step)
            plain_step(mine, opt, None, step)
        for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
            assert torch.equal(a, b)
        x, y = data(9)
        nn.functional.cross_entropy(mine(x), y).backward()
        with pytest.raises(ConfigError, match="reached this model twice"):
            nn.functional.cross_entropy(mine(x), y).backward()


def unfreeze(m: nn.Sequential, _: torch.optim.Optimizer) -> None:
    m.requires_grad_(True)


def add_a_head(m: nn.Sequential, o: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    m.append(nn.Linear(3, 3))
    o.add_param_group({"params": m[-1].parameters(), "lr": 0.05})


@pytest.mark.parametrize(("frozen", "change", "says"), [
    ((0,), unfreeze, r"^0\.weight, 0\.bias require grad now but did not"),
    ((0, 3), unfreeze, r"^0\.weight, 0\.bias, 3\.weight and 1 more require grad now"),
    ((), add_a_head, r"groups hold \[6, 2\] parameters, \[6\] when"),
])
def test_a_change_to_what_trains_asks_to_attach_again_and_then_trains_as_plain_pytorch(
        frozen: tuple[int, ...], change: Callable[[nn.Sequential, torch.optim.Optimizer], None],
        says: str) -> None:
    """A layer frozen at `attach` and unfrozen later (fine-tuning), or added with its own
    parameter group (a new head), has no hook: its gradient would be neither averaged nor
    applied. The next backward says so; attached again, the model trains exactly as it
    does without the shim."""
    ref, ref_opt, mine, opt = twins()
    for m in (ref, mine):
        for layer in frozen:
            m[layer].requires_grad_(False)
    sync = attach(mine, opt, overlap=True)
    for m, o in ((ref, ref_opt), (mine, opt)):
        plain_step(m, o, None, 0)
        change(m, o)
    with pytest.raises(ConfigError, match=says):
        plain_step(mine, opt, None, 1)
    opt.zero_grad()
    sync.close()
    with attach(mine, opt, overlap=True):
        for step in (1, 2):
            plain_step(ref, ref_opt, None, step)
            plain_step(mine, opt, None, step)
    assert_same_checkpoint(checkpoint(ref, ref_opt), checkpoint(mine, opt))


def test_a_checkpoint_with_a_peer_gone_says_which_update_it_lacks(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """With a peer gone before it sent the pending averages, they will not come: the
    state is saved as it is (an emergency save must not fail for them), and the log says
    it lacks a step. Closing drops the step too, saying so."""
    mine = model()
    opt = torch.optim.SGD(mine.parameters(), lr=0.01, momentum=0.9)
    with attach(mine, opt, overlap=True) as sync:
        plain_step(mine, opt, None, 0)
        before = copy.deepcopy(mine.state_dict())  # flushed: step 0 is in
        plain_step(mine, opt, None, 1)

        def gone(*_: Any) -> None:
            raise PeerLost(1, 1, "closed its connections without saying goodbye")

        monkeypatch.setattr(sync.engine, "wait", gone)
        with caplog.at_level("WARNING", logger="gradlane.shim.sync"):
            saved = mine.state_dict()
        for name, x in before.items():
            assert torch.equal(x, saved[name]), name  # step 1 is not applied
        assert ("rank 0: 3 of 3 layers lack step 1's update in this state: step 1: rank 1 "
                "lost: closed its connections") in caplog.text
        caplog.clear()
    assert "3 of 3 layers lack step 1's update in the model" in caplog.text


@pytest.mark.parametrize("optimizer_first", [False, True])
def test_a_checkpoint_loaded_right_after_step_is_not_overwritten_by_it(
        optimizer_first: bool) -> None:
    """Going back to a checkpoint after ``optimizer.step()``: the pending update goes
    before the load, not onto the loaded weights at the next forward."""
    ref, ref_opt, mine, opt = twins()
    with attach(mine, opt, overlap=True):
        for m, o in ((ref, ref_opt), (mine, opt)):
            plain_step(m, o, None, 0)
            saved = checkpoint(m, o)
            plain_step(m, o, None, 1)
            loads = [(m, saved["model"]), (o, saved["opt"])]
            for target, state in loads[::-1] if optimizer_first else loads:
                target.load_state_dict(state)
            for step in (2, 3):
                plain_step(m, o, None, step)
        assert_same_checkpoint(checkpoint(ref, ref_opt), checkpoint(mine, opt))


class Functional(nn.Module):
    """`proj`'s parameters are used by the model's own forward, `proj` never runs; inside
    `attn` (``nn.MultiheadAttention``), so are `out_proj`'s."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.linear(x, self.proj.weight, self.proj.bias).relu()
        return self.fc(self.attn(h, h, h, need_weights=False)[0].mean(1))


def test_parameters_used_without_their_module_are_updated_before_they_are_used() -> None:
    """No gate of their own opens: `proj`, used before any gate opened, is updated as the
    model's forward starts (it was used a step behind, then updated under autograd's
    feet); `out_proj` goes right after `attn`, whose gate updates it."""
    ref, mine = Functional(), Functional()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9)
    with attach(mine, opt, overlap=True) as sync:
        for step in range(4):
            for m, o in ((ref, ref_opt), (mine, opt)):
                g = torch.Generator().manual_seed(step)
                x, y = torch.randn(6, 5, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
                nn.functional.cross_entropy(m(x), y).backward()
                o.step()
                o.zero_grad()
        order = [layer.name for layer in sync._order]
        assert order == ["proj", "attn", "attn.out_proj", "fc"]
        assert [x.name for x in sync._at_forward_start] == ["proj"]
        assert [x.name for x in sync._by_module[mine.attn]] == ["attn", "attn.out_proj"]
    for (name, a), b in zip(ref.state_dict().items(), mine.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_what_is_left_open_is_closed_at_exit(caplog: pytest.LogCaptureFixture) -> None:
    """A Sync (or a DDP hook's state) not closed by the script is closed by the exit
    handler; one that fails to close does not keep the others open."""
    closed: list[int] = []

    class Holder:
        def __init__(self, rank: int) -> None:
            self.rank = rank
            engine_module.OPEN.add(self)

        def close(self) -> None:
            engine_module.OPEN.discard(self)
            closed.append(self.rank)
            if self.rank == 1:
                raise TransportError("a peer is gone")

    mine = model()
    opt = torch.optim.SGD(mine.parameters(), lr=0.1)
    sync = attach(mine, opt)
    assert sync in engine_module.OPEN
    holders = [Holder(1), Holder(2)]
    engine_module._close_at_exit()
    assert sync not in engine_module.OPEN and sync._closed
    assert sorted(closed) == [1, 2] and not set(engine_module.OPEN) & set(holders)
    assert "rank 1: closing at exit failed: a peer is gone" in caplog.text
    # A forked child (a DataLoader worker) that exits normally closes nothing of its
    # parent's: the connections are shared.
    child_model = model()
    with attach(child_model, torch.optim.SGD(child_model.parameters(), lr=0.1)) as sync:
        pid = os.fork()
        if pid == 0:
            os._exit(len(engine_module.OPEN))  # atexit's view in the child
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert sync in engine_module.OPEN


def test_small_layers_of_a_band_share_a_group_and_steps_stay_exact() -> None:
    # One band: the model's four small layers (all under MIN_GROUP_BYTES) form one group.
    compare(lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), dscp=(46,))
    m = model()
    sync = attach(m, torch.optim.SGD(m.parameters(), lr=0.01), dscp=(46,))
    x, y = data(0)
    nn.functional.cross_entropy(m(x), y).backward()
    assert [g.label for g in sync._groups] == ["0..5[float32]"]
    sync.close()
    # Four bands: layers of different bands never share a group.
    m = model()
    sync = attach(m, torch.optim.SGD(m.parameters(), lr=0.01))
    nn.functional.cross_entropy(m(x), y).backward()
    assert len({g.band for g in sync._groups}) == len(sync._groups) == 3
    sync.close()


@pytest.mark.parametrize(("dtype", "labels"), [
    (torch.float32, ["0..3[float32]", "4..7[float32]"]),
    (torch.float64, ["0..1[float64]", "2..3[float64]", "4..5[float64]", "6..7[float64]"])])
def test_a_group_closes_once_it_holds_the_least_bytes_of_a_group(
    dtype: torch.dtype, labels: list[str]
) -> None:
    # Eight layers of 64 x 64 + 64 parameters, one band: 16,640 bytes a layer in float32,
    # 33,280 in float64; a group closes at MIN_GROUP_BYTES (64 KiB) or more.
    assert layout_sizes(8 * 33_280, 1, 1 << 20, "fine")[0] == MIN_GROUP_BYTES == 64 << 10
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]).to(dtype)
    sync = attach(m, torch.optim.SGD(m.parameters(), lr=0.01), dscp=(46,))
    m(torch.ones(2, 64, dtype=dtype)).sum().backward()
    assert [g.label for g in sync._groups] == labels
    sync.close()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("winner", ["coarse", "fine"])
def test_layout_trial_regroups_between_steps_and_steps_stay_exact(
    winner: str, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The trial runs fine, coarse, fine, then keeps the winner (forced here: which one wins
    # depends on timing); no regrouping may change the math.
    monkeypatch.setattr(sync_module, "pick_layout", lambda fine, coarse: winner)
    _, to_coarse, coarse, to_fine, _, decide = sync_module.trial_schedule()
    assert decide == 17  # what the README and ShimConfig say
    opt = lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)  # noqa: E731
    compare(opt, steps=decide + 3, overlap=overlap)
    m = model()
    sync = attach(m, opt(m.parameters()), overlap=overlap)
    for step in range(decide + 3):  # and two steps past: the trial is over
        plain_step(m, sync.optimizer, None, step)
        expected = "coarse" if to_coarse <= step < to_fine else "fine"
        assert step >= decide or sync.layout == expected, step
    assert sync.layout == winner and sync.layout_trial is not None
    trial = sync.layout_trial
    assert (trial["chosen"], trial["step"]) == (winner, decide)
    assert trial["fine_s"] > 0 and trial["coarse_s"] > 0 and trial["steady"]
    assert 0 < trial["p_coarse_faster"] <= 1
    # New groups have new ids (a peer must never mistake one for a retired group).
    before = 2 if winner == "fine" else 3  # layouts made before the current one
    assert min(g.gid for g in sync._groups) == before * len(sync._groups)
    assert set(sync.engine.groups) == {g.gid for g in sync._groups}
    sync.close()


def test_layout_trial_times_each_step_from_its_backward_to_the_next_and_keeps_coarse_if_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A clock that moves only between steps (and a microsecond a reading): a step of the
    # coarse block takes 50 ms, every other 100 ms, so coarse is faster beyond doubt.
    _, _, coarse, _, _, decide = sync_module.trial_schedule()
    now = [0.0]

    def clock() -> float:
        now[0] += 1e-6
        return now[0]

    monkeypatch.setattr(sync_module.time, "perf_counter", clock)
    m = model()
    sync = attach(m, torch.optim.SGD(m.parameters(), lr=0.01))
    for step in range(decide + 1):
        plain_step(m, sync.optimizer, None, step)
        now[0] += 0.05 if step in coarse else 0.1  # a period: from its backward to the next
    trial = sync.layout_trial
    assert trial is not None and trial["steady"] and trial["step"] == decide
    assert trial["fine_s"] == pytest.approx(0.1, abs=1e-3)
    assert trial["coarse_s"] == pytest.approx(0.05, abs=1e-3)
    assert trial["p_coarse_faster"] == pytest.approx(1 / math.comb(12, 6))
    assert trial["chosen"] == sync.layout == "coarse"
    sync.close()


def test_p_faster_is_the_exact_one_sided_mann_whitney_test() -> None:
    fast, slow = [1.0, 2, 3, 4, 5, 6], [7.0, 8, 9, 10, 11, 12]
    assert sync_module.p_faster(fast, slow) == pytest.approx(1 / math.comb(12, 6))
    assert sync_module.p_faster(slow, fast) == 1.0
    # Interleaved: no evidence either way.
    assert 0.3 < sync_module.p_faster([1.0, 3, 5, 7, 9, 11], [2.0, 4, 6, 8, 10, 12]) < 0.7


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=4),
       st.lists(st.integers(0, 5), min_size=1, max_size=4))
def test_p_faster_matches_counting_every_relabeling(xs: list[int], ys: list[int]) -> None:
    # Under the null hypothesis every split of the pooled values (tie-broken by position,
    # so all are distinct) into |xs| and |ys| is equally likely.
    pooled = sorted(range(len(xs) + len(ys)))

    def u(a: Sequence[float], b: Sequence[float]) -> float:
        return sum(1.0 if x > y else 0.5 if x == y else 0.0 for x in a for y in b)

    observed = u([float(x) for x in xs], [float(y) for y in ys])
    splits = list(itertools.combinations(pooled, len(xs)))
    at_most = sum(
        u([float(i) for i in pick], [float(i) for i in pooled if i not in pick])
        <= int(observed)
        for pick in splits
    )
    assert sync_module.p_faster([float(x) for x in xs], [float(y) for y in ys]) == (
        pytest.approx(at_most / len(splits)))


def test_pick_layout_keeps_coarse_only_when_it_is_clearly_faster() -> None:
    fine = [0.20, 0.21, 0.19, 0.20, 0.22, 0.20]
    assert sync_module.pick_layout(fine, [x * 0.9 for x in fine]) == "coarse"
    # One stalled fine step made fine's median the slower, not its timings in general.
    noisy = [0.18, 0.24, 0.19, 0.25, 0.18, 0.24]
    assert statistics.median([0.20, 0.21, 0.20, 0.19, 0.21, 0.22]) < statistics.median(noisy)
    assert sync_module.pick_layout(noisy, [0.20, 0.21, 0.20, 0.19, 0.21, 0.22]) == "fine"
    assert sync_module.pick_layout(fine, []) == "fine"


def test_layout_trial_keeps_fine_when_the_batch_changed_during_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sync_module, "pick_layout", lambda fine, coarse: "coarse")
    m = model()
    sync = attach(m, torch.optim.SGD(m.parameters(), lr=0.01))
    _, _, coarse, _, _, decide = sync_module.trial_schedule()
    for step in range(decide + 3):
        x, y = data(step)
        cut = 4 if step == coarse.start else 6  # one smaller batch amid the trial
        nn.functional.cross_entropy(m(x[:cut]), y[:cut]).backward()
        sync.optimizer.step()
        sync.optimizer.zero_grad()
    assert sync.layout == "fine" and sync.layout_trial is not None
    assert (sync.layout_trial["chosen"], sync.layout_trial["steady"]) == ("fine", False)
    sync.close()


def test_fixed_layouts_never_regroup_and_coarse_steps_stay_exact() -> None:
    compare(lambda p: torch.optim.AdamW(p, lr=0.01), steps=4, layout="coarse")
    for layout in ("fine", "coarse"):
        m = model()
        sync = attach(m, torch.optim.SGD(m.parameters(), lr=0.01), layout=layout)
        for step in range(sync_module.trial_schedule()[5] + 2):
            plain_step(m, sync.optimizer, None, step)
        assert sync.layout == layout and sync.layout_trial is None
        assert min(g.gid for g in sync._groups) == 0
        sync.close()
    with pytest.raises(ConfigError, match="layout must be one of auto, fine, coarse"):
        attach(model(), torch.optim.SGD(model().parameters(), lr=0.01), layout="huge")
    with pytest.raises(ConfigError, match="exchange must be one of auto, flat, ring"):
        attach(model(), torch.optim.SGD(model().parameters(), lr=0.01), exchange="tree")


def test_a_step_or_clipping_out_of_place_and_what_attach_cannot_take_get_clear_errors(
) -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with attach(m, opt) as sync:
        with pytest.raises(ConfigError, match=r"^clip_grad_norm_ belongs between backward\(\) "
                                              r"and optimizer.step\(\)"):
            sync.clip_grad_norm_(1.0)
        with pytest.raises(ConfigError, match=r"^optimizer.step\(\) without a synchronized "
                                              r"backward\(\) before it"):
            opt.step()
        plain_step(m, opt, None, 0)  # and it trains on
    with pytest.raises(ConfigError, match="^rank 1 is not in 0..0"):
        gl.attach(model(), torch.optim.SGD(model().parameters(), lr=0.1), rank=1, world_size=1)
    # What is not a model, an optimizer or a number: said so, not an AttributeError from
    # deep inside (the parameters given where the optimizer goes, say).
    m = model()
    with pytest.raises(ConfigError, match=r"^attach's optimizer must be a torch.optim.Optimizer "
                                          r"\(gl.chain makes one of several\), got generator"):
        gl.attach(m, m.parameters(), rank=0, world_size=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^attach's model must be a torch.nn.Module, got "
                                          "function"):
        gl.attach(lambda x: x, opt, rank=0, world_size=1)  # type: ignore[arg-type]
    for bad in ({"rank": "0"}, {"rank": True}, {"world_size": 1.0}):
        with pytest.raises(ConfigError, match=f"^{next(iter(bad))} must be an integer, got "):
            gl.attach(model(), torch.optim.SGD(model().parameters(), lr=0.1),
                      **{"rank": 0, "world_size": 1, **bad})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^world_size must be at least 1, got 0"):
        gl.attach(model(), torch.optim.SGD(model().parameters(), lr=0.1), rank=0, world_size=0)
    alone = model()  # numpy's integers are integers
    gl.attach(alone, torch.optim.SGD(alone.parameters(), lr=0.1), rank=np.int64(0),
              world_size=np.int64(1)).close()
    with pytest.raises(ConfigError, match="^SparseAdam needs sparse gradients; gradlane averages "
                                          "dense ones"):
        attach(model(), torch.optim.SparseAdam(model().parameters()))
    frozen = model().requires_grad_(False)
    with pytest.raises(ConfigError, match="^the model has no parameters that require grad"):
        attach(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1))


def test_lr_scheduler_sees_the_step_it_scheduled() -> None:
    compare(
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        sched=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.3),
    )


def test_low_precision_and_float64() -> None:
    compare(lambda p: torch.optim.SGD(p, lr=0.1), dtype=torch.bfloat16)
    compare(lambda p: torch.optim.AdamW(p, lr=0.01), dtype=torch.float64)


def test_gradient_accumulation_with_no_sync() -> None:
    def loop(m: nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int) -> None:
        x, y = data(step)
        sync: gl.Sync | None = getattr(m, "_gl_sync", None)
        for i, (xs, ys) in enumerate(zip(x.split(2), y.split(2), strict=True)):
            last = i == 2
            ctx = sync.no_sync() if sync is not None and not last else _null()
            with ctx:
                (nn.functional.cross_entropy(m(xs), ys) / 3).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    ref, mine = model(), model()
    for m, shimmed in ((ref, False), (mine, True)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        if shimmed:
            m._gl_sync = attach(m, opt)  # type: ignore[assignment]
        for step in range(4):
            loop(m, opt, None, step)
        if shimmed:
            m._gl_sync.close()  # type: ignore[operator]
    for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_layer_only_an_accumulating_backward_reached_keeps_its_gradient() -> None:
    """`b` runs in the first micro-batch (under no_sync) but not the last: its
    accumulated gradient is still the one averaged and stepped, as in one process."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
            return self.a(self.b(x) if branch else x)

    def train(m: Branchy, shimmed: bool) -> None:
        opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5)
        sync = attach(m, opt) if shimmed else None
        for step in range(3):
            for micro in range(2):
                first = micro == 0
                ctx = sync.no_sync() if sync is not None and first else _null()
                with ctx:
                    m(torch.full((2, 4), float(step + 1)), first).sum().backward()
            opt.step()
            opt.zero_grad()
        if sync is not None:
            sync.close()

    ref, mine = Branchy(), Branchy()
    train(ref, False)
    train(mine, True)
    for (name, a), b in zip(ref.state_dict().items(), mine.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("overlap", [True, False])
def test_clipping_the_local_gradients_is_refused_not_lost(overlap: bool) -> None:
    """``torch.nn.utils.clip_grad_norm_`` after backward, as with DDP, clips the local
    gradients, which gradlane has already taken: step() says so instead of stepping
    unclipped. It looks at one layer a step, in turn, so a change to any one layer's
    gradients is found within as many steps as there are layers."""
    mine = model()
    layers = [name for name, m in mine.named_children() if list(m.parameters())]
    for clipped in layers:
        mine = model()
        opt = torch.optim.SGD(mine.parameters(), lr=0.1)
        with attach(mine, opt, overlap=overlap):
            for step in range(len(layers)):
                x, y = data(step)
                nn.functional.cross_entropy(mine(x), y).backward()
                norm = torch.nn.utils.clip_grad_norm_(mine.parameters(), 1e6)
                assert norm < 1e6  # no clip: nothing changed
                torch.nn.utils.clip_grad_norm_(mine.get_submodule(clipped).parameters(), 1e-3)
                try:
                    opt.step()
                except ConfigError as exc:
                    assert str(exc).startswith(
                        f"rank 0: the gradients of layer {clipped!r} changed between backward()"
                        " and optimizer.step() (torch.nn.utils.clip_grad_norm_?)")
                    break
                opt.zero_grad()
            else:
                pytest.fail(f"clipping layer {clipped} went unnoticed")


def test_a_change_to_one_gradient_element_past_the_first_checked_is_found(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A change to a few elements (``clip_grad_value_``) anywhere in a parameter: each
    turn of a layer compares the next `CHECKED_ELEMENTS` of each parameter, so the last
    element of the largest one is found within a round of the layers per window."""
    monkeypatch.setattr(sync_module, "CHECKED_ELEMENTS", 16)
    mine = model()
    opt = torch.optim.SGD(mine.parameters(), lr=0.1)
    weight = mine.get_submodule("3").weight  # 720 elements: 45 windows of 16
    with attach(mine, opt, overlap=True) as sync:
        rounds = len(sync._layers) * -(-weight.numel() // 16)
        with pytest.raises(ConfigError, match="the gradients of layer '3' changed"):
            for step in range(rounds):
                x, y = data(step)
                nn.functional.cross_entropy(mine(x), y).backward()
                weight.grad.view(-1)[-1] += 1.0
                opt.step()
                opt.zero_grad()


def test_nan_gradients_are_not_taken_for_changed_ones() -> None:
    mine = model()
    opt = torch.optim.SGD(mine.parameters(), lr=0.1)
    with attach(mine, opt, overlap=True) as sync:
        for step in range(len(sync._layers)):
            x, y = data(step)
            nn.functional.cross_entropy(mine(x * float("nan")), y).backward()
            assert all(p.grad.isnan().all() for p in mine.parameters() if p.grad is not None)
            opt.step()  # NaN != NaN, but they are the bits backward left
            opt.zero_grad()


def test_clip_grad_norm_on_averaged_gradients() -> None:
    def clipped(sync_of: dict[int, gl.Sync]) -> Loop:
        def loop(m: nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int) -> None:
            x, y = data(step)
            nn.functional.cross_entropy(m(x), y).backward()
            sync = sync_of.get(id(m))
            if sync is None:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            else:
                sync.clip_grad_norm_(0.05)
            opt.step()
            opt.zero_grad()

        return loop

    ref, mine = model(), model()
    syncs: dict[int, gl.Sync] = {}
    for m in (ref, mine):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        if m is mine:
            syncs[id(m)] = attach(m, opt)
        for step in range(4):
            clipped(syncs)(m, opt, None, step)
    syncs[id(mine)].close()
    for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("order", ["value", "value-then-norm", "norm-then-value"])
def test_clip_grad_value_on_averaged_gradients_keeps_the_step_layer_by_layer(
        order: str) -> None:
    """``sync.clip_grad_value_`` bounds the averages as ``torch.nn.utils.clip_grad_value_``
    bounds DDP's, in either order with a clip of the norm; alone it needs no other
    layer's average, so the step stays pending, layer by layer."""
    ref, ref_opt, mine, opt = twins(lambda p: torch.optim.SGD(p, lr=0.5))
    bounds = {"value": 0.01, "norm": 0.05}
    beyond = False  # whether some gradient was beyond the value's bound
    with attach(mine, opt, overlap=True) as sync:
        for step in range(4):
            for m, o in ((ref, ref_opt), (mine, opt)):
                x, y = data(step)
                nn.functional.cross_entropy(m(x), y).backward()
                beyond |= m is ref and any(p.grad.abs().max() > bounds["value"]
                                           for p in m.parameters() if p.grad is not None)
                for what in order.split("-then-"):
                    if m is ref:
                        clip = getattr(torch.nn.utils, f"clip_grad_{what}_")
                        clip(m.parameters(), bounds[what])
                    else:
                        getattr(sync, f"clip_grad_{what}_")(bounds[what])
                if m is ref:
                    expected = [p.grad.clone() for p in m.parameters()]
                else:  # what the step takes
                    for e, p in zip(expected, m.parameters(), strict=True):
                        assert torch.equal(e, sync.averaged_grad(p))
                o.step()
                assert m is ref or (sync._pending is not None) == (order == "value")
                o.zero_grad()
        with pytest.raises(ConfigError, match="clip_grad_value_ belongs between backward"):
            sync.clip_grad_value_(0.1)
        nn.functional.cross_entropy(mine(x), y).backward()
        with pytest.raises(ConfigError, match="clip_value must be >= 0, got -1"):
            sync.clip_grad_value_(-1)
        sync.clip_grad_value_(0)  # as torch's: every gradient to zero
        assert all(not sync.averaged_grad(p).any() for p in mine.parameters())
        sync.skip_step()
    assert beyond
    for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b)


def muon_and_adamw(m: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """Muon for `m`'s matrices (it takes nothing else), AdamW for the rest."""
    matrices = [p for p in m.parameters() if p.ndim == 2]
    rest = [p for p in m.parameters() if p.ndim != 2]
    return torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=0.01)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_model_split_between_two_optimizers_trains_chained_as_plain_pytorch(
        overlap: bool) -> None:
    """``gl.chain(muon, adamw)`` is the one optimizer attach takes; each keeps its own
    parameters, state, schedule and step hooks (once a step, layer by layer or in one
    step), so the model ends where the two optimizers stepped one after the other end
    it, bit for bit, and so do their states. The chain's state saved and loaded, copied
    and pickled is the two optimizers'."""
    ref, mine = model(), model()
    ref_opts, opts = muon_and_adamw(ref), muon_and_adamw(mine)
    schedules = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in ref_opts + opts]
    calls: list[str] = []  # each optimizer's step hooks: once a step, as plain PyTorch's
    for o in ref_opts + opts:
        name = type(o).__name__
        o.register_step_pre_hook(lambda *_, name=name: calls.append(f"{name} pre"))
        o.register_step_post_hook(lambda *_, name=name: calls.append(f"{name} post"))
    chained = gl.chain(*opts)
    with attach(mine, chained, overlap=overlap) as sync:
        # Layer by layer with overlap: both update each parameter from its own gradient.
        assert sync.layerwise == overlap
        for step in range(4):
            x, y = data(step)
            nn.functional.cross_entropy(ref(x), y).backward()
            for o in ref_opts:
                o.step()
                o.zero_grad()
            plain, calls[:] = sorted(calls), []
            nn.functional.cross_entropy(mine(x), y).backward()  # the last step's layers
            chained.step()
            assert sorted(calls) == plain, (calls, plain)
            calls.clear()
            chained.zero_grad()
            for schedule in schedules:
                schedule.step()
        saved = chained.state_dict()
        copied = copy.deepcopy(chained)
    assert [type(o) for o in copied.optimizers] == [torch.optim.Muon, torch.optim.AdamW]
    for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b)
    for ref_opt, opt, state in zip(ref_opts, opts, saved["chain"], strict=True):
        assert_same_checkpoint({"model": {}, "opt": ref_opt.state_dict()},
                               {"model": {}, "opt": state})
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]  # scheduled
    again = gl.chain(*muon_and_adamw(model()))
    again.load_state_dict(saved)
    for ref_opt, opt in zip(ref_opts, again.optimizers, strict=True):
        assert_same_checkpoint({"model": {}, "opt": ref_opt.state_dict()},
                               {"model": {}, "opt": opt.state_dict()})
    with pytest.raises(ConfigError, match="not a torch.optim.Optimizer"):
        gl.chain(opts[0], mine)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="some parameters appear in more than one"):
        gl.chain(opts[0], opts[0])
    with pytest.raises(ConfigError, match="add the group to one of the chained optimizers"):
        again.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_a_group_added_to_a_chained_optimizer_after_attach_is_refused() -> None:
    """The chain's groups are its optimizers' own, so one added to them since attach is
    seen, and refused as a group added to an attached optimizer is."""
    m = model()
    opts = muon_and_adamw(m)
    chained = gl.chain(*opts)
    with attach(m, chained, overlap=True):
        plain_step(m, chained, None, 0)
        opts[1].add_param_group({"params": nn.Linear(3, 3).parameters()})
        with pytest.raises(ConfigError, match=r"groups hold \[2, 4, 2\] parameters, \[2, 4\]"):
            plain_step(m, chained, None, 1)
        chained.zero_grad()


def test_a_chained_optimizer_stepped_alone_is_refused_before_it_steps() -> None:
    """Its own step() would step its layers with this worker's gradients: refused at the
    call, no weight moved, and the chain's step() goes on as if it had not been tried."""
    m = model()
    opts = muon_and_adamw(m)
    chained = gl.chain(*opts)
    with attach(m, chained, overlap=True):
        x, y = data(0)
        nn.functional.cross_entropy(m(x), y).backward()
        before = [p.detach().clone() for p in m.parameters()]
        for o in opts:
            with pytest.raises(ConfigError, match=rf"{type(o).__name__}\.step\(\) called on an "
                               "optimizer of the chain attached: call the chain's step"):
                o.step()
        assert all(torch.equal(a, p) for a, p in zip(before, m.parameters(), strict=True))
        chained.step()
        chained.zero_grad()
        plain_step(m, chained, None, 1)
    for o in opts:  # detached: each is an optimizer of its own again
        o.step()


def test_lbfgs_closure_falls_back_to_whole_model_steps() -> None:
    def loop(m: nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int) -> None:
        x, y = data(step)

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            return loss

        opt.step(closure)

    compare(lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=3), loop=loop, steps=3)


def test_parameters_no_rank_used_are_left_alone_as_plain_pytorch_leaves_them() -> None:
    """No gradient anywhere: the optimizer skips the parameter (no weight decay, no
    moments), as it does in one process and under DDP; a zero gradient would decay it."""

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)  # b never runs

    def train(m: nn.Module, shimmed: bool) -> None:
        opt = torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5)
        with attach(m, opt) if shimmed else contextlib.nullcontext():
            for _ in range(3):
                m(torch.ones(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()

    ref, mine = Branchy(), Branchy()
    before = mine.b.weight.detach().clone()
    train(ref, False)
    train(mine, True)
    assert torch.equal(mine.b.weight, before)
    for (name, a), b in zip(ref.state_dict().items(), mine.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_grad_scaler_is_refused_at_its_first_step() -> None:
    """GradScaler unscales each worker's own gradients; stepping the scaled averages would
    move the weights `scale` times too far, so the step refuses, naming it."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    before = [p.detach().clone() for p in m.parameters()]
    with attach(m, opt):
        x, y = data(0)
        scaler.scale(nn.functional.cross_entropy(m(x), y)).backward()
        with pytest.raises(ConfigError, match="GradScaler"):
            scaler.step(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))


@pytest.mark.parametrize("gradients", [False, True])
def test_an_evaluation_between_steps_is_neither_timed_nor_counted_as_training(
        monkeypatch: pytest.MonkeyPatch, gradients: bool) -> None:
    """The compute time each step reports (gradlaned's and the control plane's view of a
    worker's pace, which batch shares follow) starts at the first forward with gradients
    in training mode: an evaluation after a step, 0.3 s here, under ``torch.no_grad()``
    or in eval mode with gradients left on, is not in it; nor are its samples in the
    count the averages weigh this rank's gradients by. A model trained in eval mode
    (every forward in it) is still counted and timed."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with attach(m, opt) as sync:
        reported: list[float] = []
        counted: list[int] = []
        monkeypatch.setattr(sync.client, "timing", lambda compute, comm: reported.append(compute))
        begin = sync.client.begin
        monkeypatch.setattr(sync.client, "begin",
                            lambda step, known: (counted.append(known), begin(step, known))[1])
        for step in range(3):
            plain_step(m, opt, None, step)
            if step == 2:
                break
            m.eval()
            with contextlib.nullcontext() if gradients else torch.no_grad():
                m(torch.randn(50, 3, 8, 8))
                time.sleep(0.3)  # as more evaluation batches would take
            m.train()
        m.eval()
        plain_step(m, opt, None, 3)
    assert counted == [6, 6, 6, 6]
    assert len(reported) == 4 and max(reported[1:3]) < 0.3, reported


def test_a_model_called_with_keywords_only_counts_its_samples(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``model(input_ids=..., attention_mask=...)``, as Hugging Face models are called:
    the samples are the first tensor keyword's first dimension (none was found: the
    rank's gradients weighed as one sample, and gradlaned told the count is unknown)."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with attach(m, opt) as sync:
        counted: list[int] = []
        begin = sync.client.begin
        monkeypatch.setattr(sync.client, "begin",
                            lambda step, known: (counted.append(known), begin(step, known))[1])
        for step in range(2):
            x, y = data(step)
            nn.functional.cross_entropy(m(input=x), y).backward()
            opt.step()
            opt.zero_grad()
    assert counted == [6, 6]


def test_misuse_gets_clear_errors() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with attach(m, opt) as sync:
        x, y = data(0)
        nn.functional.cross_entropy(m(x), y).backward()
        # The ways out: accumulate under no_sync, freeze a model another's loss reaches,
        # or skip the step.
        with pytest.raises(ConfigError, match=r"reached this model twice without its optimizer"
                           r".*sync.no_sync\(\).*requires_grad_\(False\).*optimizer.zero_grad"
                           r"\(\) or sync.skip_step\(\) in its place"):
            nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        with pytest.raises(ConfigError, match="skip_step belongs between backward"):
            sync.skip_step()
    other = model()
    with pytest.raises(ConfigError, match=r"^0\.bias requires grad but is not in the optimizer: "
                                          "gradlane steps every parameter that trains"):
        attach(other, torch.optim.SGD(list(other.parameters())[:1], lr=0.1))
    with pytest.raises(ConfigError, match="chunk_bytes"):
        attach(model(), torch.optim.SGD(model().parameters(), lr=0.1), chunk_bytes=10)
    with (mock.patch.dict(os.environ), pytest.raises(ConfigError, match="^RANK is not set")):
        os.environ.pop("RANK", None)
        gl.attach(model(), torch.optim.SGD(model().parameters(), lr=0.1), world_size=1)
    with (mock.patch.dict(os.environ, {"RANK": "one"}),
          pytest.raises(ConfigError, match="RANK and WORLD_SIZE must be integers")):
        gl.attach(model(), torch.optim.SGD(model().parameters(), lr=0.1), world_size=1)
    with (mock.patch.dict(os.environ), pytest.raises(ConfigError, match="^MASTER_PORT is not set")):
        os.environ.pop("MASTER_PORT", None)
        gl.attach(model(), torch.optim.SGD(model().parameters(), lr=0.1), rank=0, world_size=2)
    with pytest.raises(ConfigError, match="unknown option 'chunk_byte': did you mean "
                                          "'chunk_bytes'"):
        attach(model(), torch.optim.SGD(model().parameters(), lr=0.1), chunk_byte=4096)
    for port in ("99999", "http"):
        with (mock.patch.dict(os.environ, {"MASTER_PORT": port}),
              pytest.raises(ConfigError, match=f"must be a TCP port 1..65535, got {port}")):
            gl.attach(model(), torch.optim.SGD(model().parameters(), lr=0.1), rank=0, world_size=1)
    # A model or an optimizer attached twice would have its gradients hooked and its
    # step patched twice; after close() it may be attached again.
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with attach(m, opt):
        with pytest.raises(ConfigError, match="Sequential is attached already"):
            attach(m, torch.optim.SGD(m.parameters(), lr=0.1))
        with pytest.raises(ConfigError, match="SGD is attached already"):
            attach(model(), opt)
    with attach(m, opt):
        pass
    # Nor may a parameter: a model holding an attached one, or a weight two models share,
    # would be averaged by two Syncs and stepped by two optimizers.
    outer = nn.Sequential(m, nn.Linear(3, 2))
    twin = nn.Sequential(nn.Conv2d(3, 4, 3))
    twin[0].weight = m[0].weight
    with attach(m, opt):
        with pytest.raises(ConfigError, match=r"^0\.0\.weight is attached already, in the "
                                              "open Sync of a Sequential"):
            attach(outer, torch.optim.SGD(outer.parameters(), lr=0.1))
        with pytest.raises(ConfigError, match=r"^0\.weight is attached already"):
            attach(twin, torch.optim.SGD(twin.parameters(), lr=0.1))
    with attach(outer, torch.optim.SGD(outer.parameters(), lr=0.1)):  # m's Sync closed
        pass
    temperature = nn.Parameter(torch.ones(()))  # an optimizer's, outside either model
    with attach(m, torch.optim.SGD([*m.parameters(), temperature], lr=0.1)):
        other = model()
        with pytest.raises(ConfigError, match="^a parameter the optimizer holds outside the "
                                              "model is attached already"):
            attach(other, torch.optim.SGD([*other.parameters(), temperature], lr=0.1))
    # Sparse gradients (an embedding with sparse=True), at attach and at the DDP hook's
    # state, before anything needs a process group: not torch's error in backward.
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(8, 3))
    with pytest.raises(ConfigError, match=r"^0: sparse gradients \(sparse=True\)"):
        attach(sparse, torch.optim.SGD(sparse.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match=r"^0: sparse gradients"):
        gl.HookState(sparse)
    # Many: the first three named; a frozen one needs no gradient.
    many = nn.ModuleList(nn.Embedding(10, 4, sparse=True) for _ in range(5))
    many[0].requires_grad_(False)
    with pytest.raises(ConfigError, match=r"^1, 2, 3: sparse gradients \(sparse=True\)"):
        gl.HookState(many)
    # Parameters off the CPU (here the meta device, as a CUDA one would be) are refused.
    elsewhere = model().to("meta")
    with pytest.raises(ConfigError, match="only dense CPU parameters"):
        attach(elsewhere, torch.optim.SGD(elsewhere.parameters(), lr=0.1))


def test_a_model_in_a_data_parallel_wrapper_is_refused_saying_what_to_attach() -> None:
    """DDP or DataParallel around the model (or a part of it) would average every
    gradient itself, a second time and outside gradlane's lanes; FSDP shards it."""
    m = model()
    with pytest.raises(ConfigError, match=r"^the model is a DataParallel, which averages "
                                          r"the gradients itself: attach the module it wraps "
                                          r"\(model.module\)$"):
        attach(nn.DataParallel(m), torch.optim.SGD(m.parameters(), lr=0.1))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        outer = nn.Sequential(nn.parallel.DistributedDataParallel(m), nn.Linear(3, 3))
        with pytest.raises(ConfigError, match=r"^0 is a DistributedDataParallel, .*\(0.module\)"
                                              r"; or keep DDP with gradlane's comm hook"):
            attach(outer, torch.optim.SGD(outer.parameters(), lr=0.1))
        from torch.distributed.fsdp import fully_shard
        sharded = fully_shard(model())
        with pytest.raises(ConfigError, match="^the model is sharded by FSDP: gradlane averages "
                                              "whole replicas"):
            attach(sharded, torch.optim.SGD(sharded.parameters(), lr=0.1))
    finally:
        dist.destroy_process_group()


def test_a_model_wrapped_in_ddp_after_attach_is_refused_at_its_first_forward() -> None:
    """`_refuse_wrapped` sees wrappers inside the model at attach; DDP put around the
    model afterwards would average every gradient a second time. Its forward is refused;
    an evaluation without gradients, which averages nothing, is not."""
    m = model()
    sync = attach(m, torch.optim.SGD(m.parameters(), lr=0.1))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(m)
        with torch.no_grad():
            wrapped(torch.randn(2, 3, 8, 8))
        with pytest.raises(ConfigError, match=r"^0.weight is attached and also averaged by "
                                              r"the DistributedDataParallel wrapped around"):
            wrapped(torch.randn(2, 3, 8, 8))
        m(torch.randn(2, 3, 8, 8)).sum().backward()  # outside DDP's forward: attach's own
        sync.optimizer.step()
    finally:
        dist.destroy_process_group()
        sync.close()


def test_a_ddp_that_ignores_every_attached_parameter_is_let_be_and_walked_once() -> None:
    """DDP around a larger model, told to ignore the attached part's parameters, averages
    none of them twice: its forward runs; its parameters are looked at once, not at every
    forward."""
    m = model()
    sync = attach(m, torch.optim.SGD(m.parameters(), lr=0.1))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        outer = nn.Sequential(m, nn.Linear(3, 3))
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            outer, [f"0.{name}" for name, _ in m.named_parameters()])
        wrapped = nn.parallel.DistributedDataParallel(outer)
        walks = 0
        named_parameters = outer.named_parameters

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal walks
            walks += 1
            return named_parameters(*args, **kwargs)

        outer.named_parameters = counted  # type: ignore[method-assign]
        for _ in range(3):
            wrapped(torch.randn(2, 3, 8, 8)).sum().backward()
            sync.optimizer.step()
            sync.optimizer.zero_grad()
        assert walks == 1
    finally:
        dist.destroy_process_group()
        sync.close()


def test_a_ddp_hook_state_that_fails_to_start_leaves_nothing_running(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Its daemon client and listening sockets are up before the ranks agree their routes:
    # a failure there (a store gone, a peer that never posts) takes them down with it, and
    # the model can try again.
    m = model()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fds = len(os.listdir("/proc/self/fd"))
        meshes: list[Mesh] = []  # held: a mesh let go would close its sockets as it is freed
        real = Mesh.__init__

        def kept(mesh: Mesh, *args: Any, **kwargs: Any) -> None:
            real(mesh, *args, **kwargs)
            meshes.append(mesh)

        def broken(*args: Any, **kwargs: Any) -> Any:
            assert any(t.name.startswith("gl-") for t in threading.enumerate())  # the client's
            assert len(os.listdir("/proc/self/fd")) > fds  # and the mesh's listener
            raise TransportError("rank 0: rendezvous failed: the store is gone")

        with monkeypatch.context() as patched:
            patched.setattr(Mesh, "__init__", kept)
            patched.setattr(ddp_module, "reduction_groups", broken)
            with pytest.raises(TransportError, match="^rank 0: rendezvous failed: the store"):
                gl.HookState(m, daemon_socket="/nonexistent/gl.sock", job="init-fails")
        assert not [t for t in threading.enumerate() if t.name.startswith("gl-")]
        assert len(os.listdir("/proc/self/fd")) == fds and len(meshes) == 1
        gl.HookState(m, daemon_socket="/nonexistent/gl.sock", job="init-fails").close()
    finally:
        dist.destroy_process_group()


def test_an_ipv6_rendezvous_is_refused_saying_why() -> None:
    # Resolving would say only "Address family for hostname not supported".
    with pytest.raises(TransportError, match="IPv6 only.*IPv4 only"):
        local_address("fd00::1")
    never = object()  # refused before the store is used
    with pytest.raises(TransportError, match="'::1' is not an IPv4 address"):
        Mesh(0, 2, never, "::1", (46,), credit_bytes=1 << 17)  # type: ignore[arg-type]


def test_a_job_is_named_by_its_rendezvous_address_unless_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    assert gl.ShimConfig().job == "default"
    # Every rank of a torchrun job sees the same rendezvous; two jobs cannot share one.
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert gl.ShimConfig().job == "10.0.0.1:29500"
    assert gl.ShimConfig(job="bert").job == "bert"
    for half in ("MASTER_ADDR", "MASTER_PORT"):  # half a rendezvous names no job
        with monkeypatch.context() as only:
            only.delenv(half)
            assert gl.ShimConfig().job == "default"
    with pytest.raises(ConfigError, match="job must be"):
        gl.ShimConfig(job="_gradlane")


def test_close_restores_the_optimizer_and_the_model_and_removes_hooks() -> None:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    cls = type(opt)
    sync = attach(m, opt)
    assert isinstance(opt, torch.optim.SGD) and type(opt) is not cls
    assert isinstance(m, nn.Sequential) and type(m) is not nn.Sequential  # zero_grad skips
    sync.close()
    assert type(opt) is cls and type(m) is nn.Sequential
    plain = copy.deepcopy(m)
    x, y = data(0)
    for mm in (m, plain):
        o = opt if mm is m else torch.optim.SGD(mm.parameters(), lr=0.1)
        nn.functional.cross_entropy(mm(x), y).backward()
        o.step()
    for a, b in zip(m.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def test_advised_batch_size_follows_the_daemons_plan() -> None:
    m = nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sync = attach(m, opt)
    try:
        assert sync.advised_batch_size is None  # no daemon, no control plane: no advice
        # What the daemon client stores from a plan message carrying the control plane's share.
        sync.client._handle({"type": "plan", "version": 3, "bands": None, "batch_share": 12,
                             "ownership": None})
        assert sync.advised_batch_size == 12
        sync.client._handle({"type": "plan", "version": 4, "bands": None, "batch_share": None,
                             "ownership": None})
        assert sync.advised_batch_size is None
    finally:
        sync.close()


def test_a_group_of_whole_chunks_keeps_its_chunk_count_with_its_flags() -> None:
    """The per-parameter flags ride in the last chunk: 16 KiB of gradient in 4 KiB chunks
    is four chunks (four owners' worth), not four and a 4-byte fifth."""
    m = nn.Sequential(nn.Linear(64, 64, bias=False))
    sync = attach(m, torch.optim.SGD(m.parameters(), lr=0.01), chunk_bytes=4096, layout="fine")
    m(torch.randn(2, 64)).sum().backward()
    (group,) = sync._groups
    assert [c.stop - c.start for c in group.chunks] == [1024, 1024, 1024, 1025]
    sync.close()


def test_a_rank_unlike_rank_0_is_told_its_first_difference() -> None:
    """Options or world size first (either alone), then the first parameter that
    differs, then the count."""
    ref = {"params": [["0", 0, [4, 3], "torch.float32"], ["0", 1, [4], "torch.float32"]],
           "options": {"bands": 4}, "world": 2}
    first = sync_module._first_difference
    for other in ({"options": {"bands": 2}}, {"world": 3}):
        said = first(ref, {**ref, **other}, 1)
        assert said.startswith("rank 1 was attached with options"), said
        assert "rank 0 with {'bands': 4} (world 2)" in said
    shape = {**ref, "params": [["0", 0, [4, 5], "torch.float32"], *ref["params"][1:]]}
    assert first(ref, shape, 1) == (
        "rank 1's model differs from rank 0's: 0 parameter 0 is [4, 5] torch.float32, "
        "rank 0 has 0 parameter 0 [4, 3] torch.float32")
    fewer = {**ref, "params": ref["params"][:1]}
    assert first(ref, fewer, 1) == (
        "rank 1's model has 1 trainable parameters, rank 0's has 2")


def test_the_wait_for_averages_counted_is_time_training_spent() -> None:
    """`last_exposed_comm_s` (what the bench records as a step's wait): seconds the
    forward and the step waited for averages since the backward before, so never
    negative nor more than the time trained since attach."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with attach(m, opt, overlap=True) as sync:
        started = time.perf_counter()
        for step in range(4):
            plain_step(m, opt, None, step)
            assert 0 <= sync.last_exposed_comm_s <= time.perf_counter() - started, step


def test_the_global_batch_is_the_first_step_s() -> None:
    """What the ranks agree at the first backward (the batch the control plane splits),
    kept when a later batch is smaller (an epoch's last)."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with attach(m, opt, overlap=True) as sync:
        for step, n in enumerate((6, 6, 3)):
            x, y = data(step)
            nn.functional.cross_entropy(m(x[:n]), y[:n]).backward()
            opt.step()
            opt.zero_grad()
            assert sync.global_batch == 6, step


@contextlib.contextmanager
def _one_rank_hook(m: nn.Module, ddp: dict[str, Any] | None = None, **options: Any
                   ) -> Iterator[tuple[nn.Module, gl.HookState]]:
    """DDP (given `ddp`'s options) around `m` in a process group of one, with gradlane's
    comm hook (given `options`)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(m, **(ddp or {}))
        state = gl.HookState(wrapped, daemon_socket="/nonexistent/gl.sock", **options)
        wrapped.register_comm_hook(state, gl.comm_hook)
        try:
            yield wrapped, state
        finally:
            state.close()
    finally:
        dist.destroy_process_group()


def test_the_ddp_hook_s_global_batch_is_the_first_step_s() -> None:
    """As `attach`'s: the samples the ranks agree at the first bucket of the first step,
    kept when a later batch is smaller (an epoch's last)."""
    with _one_rank_hook(model(), job="batch") as (wrapped, state):
        for step, n in enumerate((6, 6, 3)):
            state.samples = n
            x, y = data(step)
            nn.functional.cross_entropy(wrapped(x[:n]), y[:n]).backward()
            assert state.global_batch == 6, step


def test_the_ddp_hook_cuts_attach_s_fine_chunks_for_the_model() -> None:
    """A quarter of a rank's share of the model's gradient bytes (`layout_sizes`): on one
    rank, 526,336 bytes give chunks of 131,584, under the configured 1 MiB."""
    with _one_rank_hook(nn.Linear(256, 512), job="chunks", chunk_bytes=1 << 20) as (_, state):
        assert state.chunk_bytes == 131_584  # 131,584 parameters of 4 bytes


class _ReadySmallFirst(nn.Module):
    """Registered small, big, big, small (1,000 and 10,000 parameters); used big, big,
    small, small, so backward has the small ones' gradients first."""

    def __init__(self) -> None:
        super().__init__()
        self.s1, self.b1, self.b2, self.s2 = (nn.Parameter(torch.randn(n))
                                              for n in (1000, 10_000, 10_000, 1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for p in (self.b1, self.b2, self.s1, self.s2):
            x = x * p.mean()
        return x


def test_the_ddp_hook_follows_a_rebuild_into_fewer_buckets_and_frees_the_old_ones() -> None:
    """Under a 40,000-byte cap, DDP's first buckets (in registration order) hold 1, 1 and 2
    parameters; after the first step it rebuilds them in gradient-ready order into 2. The
    hook keeps DDP's buckets only, its engine forgets the groups of the old ones (each held
    a copy of its bucket's gradient and another of its average), and the gradients stay
    right (on one rank, the average is the rank's own)."""
    torch.manual_seed(0)
    m = _ReadySmallFirst()
    reference = copy.deepcopy(m)
    with _one_rank_hook(m, ddp={"bucket_cap_mb_list": [40_000 / 2**20]},
                        job="rebuild") as (wrapped, state):
        for step in range(3):
            x = torch.full((4,), 1.0 + step)
            for net in (wrapped, reference):
                net.zero_grad()
                net(x).sum().backward()
            for p, q in zip(m.parameters(), reference.parameters(), strict=True):
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
            assert set(state.engine.groups) == set(state._groups), step
            assert len(state._buckets) == (3 if step == 0 else 2), step
        rebuilt = wrapped._get_ddp_logging_data()["rebuilt_bucket_sizes"]
        assert rebuilt == "48000, 40000"  # DDP's own account: 2 buckets, bytes each


def test_a_group_still_under_way_when_ddp_rebuilds_is_forgotten_only_once_averaged() -> None:
    """DDP rebuilds its buckets at the second step (as above). One of the old buckets'
    groups is made to look under way (made ready in that step, its average not in, as
    when an engine thread is still on it): the engine keeps it through the rebuild while
    the others go, and forgets it at the first step after its average is in."""
    m = _ReadySmallFirst()
    with _one_rank_hook(m, ddp={"bucket_cap_mb_list": [40_000 / 2**20]},
                        job="rebuild-busy") as (wrapped, state):
        def step(k: int) -> None:
            wrapped.zero_grad()
            wrapped(torch.full((4,), 1.0 + k)).sum().backward()

        step(0)
        old = list(state._groups.values())
        assert len(old) > 1 and all(g.done_step == 0 for g in old)
        busy = old[0]
        busy.step = 1  # made ready in step 1, its average not in yet
        step(1)
        assert busy not in state._groups.values()  # DDP's bucket went: the hook's too
        assert state._stale == [busy]
        assert set(state.engine.groups) == {*state._groups, busy.gid}
        step(2)  # still under way: kept
        assert state._stale == [busy] and busy.gid in state.engine.groups
        busy.done_step = 1  # its average is in
        step(3)
        assert state._stale == []
        assert set(state.engine.groups) == set(state._groups)


def test_a_ddp_hook_state_before_init_process_group_is_refused_saying_so() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match=r"^HookState needs "
                                          r"torch.distributed.init_process_group\(\) first$"):
        gl.HookState(model())
    with pytest.raises(ConfigError, match=r"^HookState's model must be the "
                                          r"DistributedDataParallel \(a torch.nn.Module\), got "
                                          r"generator$"):
        gl.HookState(model().parameters())  # type: ignore[arg-type]


def test_an_attach_that_fails_to_connect_leaves_nothing_running_and_can_be_retried(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 dies after the ranks compared models, before connecting (its connect raises
    # here, as a crash there would stop it): rank 0 waits the timeout, raises, and has
    # stopped the daemon client it had started and closed its sockets; the model and its
    # optimizer can be attached again.
    real = Mesh.connect

    def connect(mesh: Mesh, peers: Any) -> None:
        if mesh.rank == 1:
            mesh.close()
            raise TransportError("rank 1: died before connecting")
        real(mesh, peers)

    monkeypatch.setattr(Mesh, "connect", connect)
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=20))  # a rendezvous gone wrong fails, not hangs
    kept: dict[int, tuple[nn.Module, torch.optim.Optimizer]] = {}
    raised: dict[int, str] = {}
    fds = len(os.listdir("/proc/self/fd"))

    def body(rank: int) -> None:
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        kept[rank] = m, opt
        try:
            # A job of its own: the meetings of rank 0's earlier attaches in this process
            # (world size 1) are not rank 1's (`meeting_prefix` counts them per job).
            gl.attach(m, opt, rank=rank, world_size=2, store=store, address="127.0.0.1",
                      daemon_socket="/nonexistent/gl.sock", timeout_s=1, job="connect-fails")
        except TransportError as exc:
            raised[rank] = str(exc)

    on_every_rank(2, body)
    assert raised == {0: "rank 0: ranks [1] did not connect within 1 s",
                      1: "rank 1: died before connecting"}
    assert not [t for t in threading.enumerate() if t.name.startswith("gl-")]
    assert len(os.listdir("/proc/self/fd")) == fds
    m, opt = kept[0]
    attach(m, opt).close()


@pytest.mark.parametrize("bad", [32.5, -1, True, "32", torch.tensor(32), 1 << 25])
def test_samples_set_by_hand_are_a_whole_count_checked_where_they_are_set(bad: object) -> None:
    """`samples` weighs this rank's gradients and goes in each chunk's header and to
    gradlaned: a float reached the header only in the backward (struct.error from a hook),
    a negative count the engine, a count past what a control plane plans by every
    report. Refused at the line that sets it; numpy's integers are kept as int."""
    m = model()
    with attach(m, torch.optim.SGD(m.parameters(), lr=0.1)) as sync, \
            _one_rank_hook(model(), job="samples") as (_, state):
        for handle in (sync, state):
            with pytest.raises(ConfigError, match="^samples must be a whole number "
                                                  "0..16777216 or None, got "):
                handle.samples = bad
            assert handle.samples is None  # left as it was
            handle.samples = np.int64(24)
            assert handle.samples == 24 and type(handle.samples) is int
            for edge in (0, 1 << 24):  # a rank with no samples this step; the most
                handle.samples = edge
                assert handle.samples == edge
            handle.samples = None
        sync.samples = 4
        x, y = data(0)
        nn.functional.cross_entropy(m(x[:4]), y[:4]).backward()
        assert sync.global_batch == 4 and sync.samples is None  # taken for the step
