"""`attach` with several ranks on random models: the replicas end identical, and where
plain PyTorch on the whole batch ends.

Each rank is a thread of this process with its own model and optimizer, over
real TCP connections on loopback (no daemon). Hypothesis draws the model
(widths, depth, a layer applied twice, a layer that gets no gradient, dtype),
the optimizer, overlap, layout, exchange, each rank's batch size and the
steps. The reference trains one model on the concatenated batch of every step
with the loss averaged over it; the ranks' sample-weighted average of their
own mean gradients is the same gradient, up to rounding.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import gradlane.shim as gl
import gradlane.shim.sync as sync_module
from gradlane.errors import ConfigError
from gradlane.shim.transport import agree_batch, get_all, reduction_groups, same_host
from tests import examples
from tests.ranks import on_every_rank


def muon_and_sgd(params: Any) -> torch.optim.Optimizer:
    """Muon for the matrices (it takes nothing else), SGD for the rest, chained."""
    params = list(params)
    return gl.chain(torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.02),
                    torch.optim.SGD([p for p in params if p.ndim != 2], lr=0.05, momentum=0.9))


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.01),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01),
    "muon+sgd": muon_and_sgd,
}
_jobs = itertools.count()


@dataclass(frozen=True)
class Case:
    widths: tuple[int, ...]  # input, hidden..., classes
    twice: bool  # the first hidden layer (square) runs twice per forward
    unused: bool  # a layer the forward never calls: its gradient is zero
    dtype: torch.dtype
    optimizer: str
    overlap: bool
    layout: str
    exchange: str
    batches: tuple[int, ...]  # per rank
    steps: int
    branch: tuple[bool, ...] = ()  # per rank: its samples also go through `Net.branch`
    frozen: bool = False  # the first layer's bias does not train (requires_grad off)
    clip: float | None = None  # clip the (averaged) gradients' global norm to this
    split: bool = False  # biases in a second parameter group (half the lr, no decay)
    schedule: bool = False  # the lr decays every step (LambdaLR)
    leaves: tuple[int, ...] | None = None  # per rank, its leaf switch (reduced in leaves first)
    scrambled: bool = False  # ranks but 0 start from other weights (attach copies rank 0's)
    hosts: tuple[int, ...] | None = None  # per rank, its host (an address of its own)
    outside: bool = False  # a learned temperature the optimizer has and the model not
    ema: bool = False  # an AveragedModel (EMA) of the model, updated after every step
    planes: int = 1  # addresses a rank (NICs): 127.0.0.h, then 127.0.1.h, ...
    chunk_bytes: int | None = None  # the shim's, and the copy's pieces (default: the shim's)


class Net(nn.Module):
    def __init__(self, case: Case) -> None:
        super().__init__()
        torch.manual_seed(0)
        w = case.widths
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(w))
        self.square = nn.Linear(w[1], w[1]) if case.twice else None
        self.spare = nn.Linear(w[-1], w[-1]) if case.unused else None
        self.branch = nn.Linear(w[1], w[1])  # used by some ranks' samples, or none
        self.layers[0].bias.requires_grad_(not case.frozen)
        self.to(case.dtype)
        # Not the model's: kept past Module's registration, as a loss's own would be.
        self.__dict__["temperature"] = (
            nn.Parameter(torch.tensor(1.5, dtype=case.dtype)) if case.outside else None)

    def trained(self) -> list[nn.Parameter]:
        """The parameters the optimizer has: the model's, and the temperature."""
        return [*self.parameters(), *([self.temperature] if self.temperature is not None
                                      else [])]

    def forward(self, x: torch.Tensor, branch: bool = False) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        if self.square is not None:
            x = torch.tanh(self.square(torch.tanh(self.square(x))))
        if branch:
            x = x + torch.tanh(self.branch(x))
        for layer in self.layers[1:]:
            x = layer(x)
        return x if self.temperature is None else x * self.temperature


@st.composite
def cases(draw: st.DrawFn) -> Case:
    world = draw(st.integers(2, 4))
    # Adam's and RMSprop's first steps are about lr * sign(g): where g is ~0, the last-ulp
    # differences of another summation order flip whole steps. So they run in float64.
    optimizer, dtype = draw(st.sampled_from([
        ("sgd", torch.float32), ("sgd", torch.float64), ("adamw", torch.float64),
        ("rmsprop", torch.float64),
    ]))
    return Case(
        widths=tuple(draw(st.lists(st.integers(2, 160), min_size=2, max_size=4))),
        twice=draw(st.booleans()),
        unused=draw(st.booleans()),
        dtype=dtype,
        optimizer=optimizer,
        overlap=draw(st.booleans()),
        layout=draw(st.sampled_from(["fine", "coarse"])),
        exchange=draw(st.sampled_from(["flat", "ring"])),
        batches=tuple(draw(st.lists(st.integers(1, 4), min_size=world, max_size=world))),
        steps=draw(st.integers(1, 3)),
        branch=tuple(draw(st.lists(st.booleans(), min_size=world, max_size=world))),
        frozen=draw(st.booleans()),
        clip=draw(st.sampled_from([None, 0.1, 10.0])),
        split=draw(st.booleans()),
        schedule=draw(st.booleans()),
        leaves=draw(st.none() | st.lists(st.integers(0, 1), min_size=world, max_size=world)
                    .map(tuple)),
        scrambled=draw(st.booleans()),
        outside=draw(st.booleans()),
        ema=draw(st.booleans()),
        planes=draw(st.sampled_from([1, 2])),
        chunk_bytes=draw(st.sampled_from([None, 4096])),  # 4 KiB: many chunks and pieces
    )


def batch(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s global batch; rank r takes its slice."""
    g = torch.Generator().manual_seed(step)
    n = sum(case.batches)
    x = torch.randn(n, case.widths[0], generator=g, dtype=torch.float64).to(case.dtype)
    return x, torch.randint(0, case.widths[-1], (n,), generator=g)


def optimizer(case: Case, model: Net) -> tuple[torch.optim.Optimizer, Any]:
    """The case's optimizer over `model`, and its lr schedule (or None)."""
    params: Any = model.parameters()
    if case.split:
        biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
        rest = [p for name, p in model.named_parameters() if not name.endswith("bias")]
        params = [{"params": rest}, {"params": biases, "weight_decay": 0.0}]
    opt = OPTIMIZERS[case.optimizer](params)
    if case.split:
        opt.param_groups[1]["lr"] *= 0.5
    if model.temperature is not None:
        opt.add_param_group({"params": [model.temperature]})
    if not case.schedule:
        return opt, None
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))


def train_rank(case: Case, rank: int, model: Net, store: dist.Store, job: str,
               linked: dict[int, list[int]] | None = None) -> dict[str, torch.Tensor]:
    opt, sched = optimizer(case, model)
    start = sum(case.batches[:rank])
    host = 1 + (case.hosts[rank] if case.hosts else 0)
    sizes = {} if case.chunk_bytes is None else {"chunk_bytes": case.chunk_bytes}
    with gl.attach(model, opt, rank=rank, world_size=len(case.batches), store=store,
                   address=[f"127.0.{plane}.{host}" for plane in range(case.planes)],
                   daemon_socket="/nonexistent/gl.sock", job=job, **sizes,
                   timeout_s=30, overlap=case.overlap, layout=case.layout,
                   exchange=case.exchange,
                   leaf=None if case.leaves is None else case.leaves[rank]) as sync:
        if linked is not None:
            linked[rank] = sync.mesh.peers()
        ema = averaging(case, model)  # a deep copy of the attached model
        for step in range(case.steps):
            x, y = batch(case, step)
            mine = slice(start, start + case.batches[rank])
            uses = bool(case.branch) and case.branch[rank]
            nn.functional.cross_entropy(model(x[mine], uses), y[mine]).backward()
            if case.clip is not None:
                sync.clip_grad_norm_(case.clip)
            opt.step()
            if sched is not None:
                sched.step()
            if ema is not None:  # reads the weights right after the step, as EMAs do
                ema.update_parameters(model)
            opt.zero_grad()
        sync.flush()
        # What the control plane would split into batch shares: every rank's first batch.
        assert sync.global_batch == sum(case.batches), (rank, sync.global_batch)
    return state(model, ema)


def averaging(case: Case, model: Net) -> AveragedModel | None:
    """The EMA `case.ema` keeps of `model` (None without), started as AveragedModel does,
    from a deep copy of it."""
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9)) if case.ema else None


def state(model: Net, ema: AveragedModel | None) -> dict[str, torch.Tensor]:
    """`model`'s state, with the temperature it trains outside it and its EMA's."""
    kept = {k: v.clone() for k, v in model.state_dict().items()}
    if model.temperature is not None:
        kept["<temperature>"] = model.temperature.detach().clone()
    if ema is not None:
        kept |= {f"<ema>.{k}": v.clone() for k, v in ema.state_dict().items()}
    return kept


def reference(case: Case) -> dict[str, torch.Tensor]:
    model = Net(case)
    opt, sched = optimizer(case, model)
    ema = averaging(case, model)
    for step in range(case.steps):
        x, y = batch(case, step)
        # The mean over the whole batch, each rank's slice through the branch or not.
        start, loss = 0, torch.zeros((), dtype=case.dtype)
        for rank, n in enumerate(case.batches):
            part = slice(start, start + n)
            uses = bool(case.branch) and case.branch[rank]
            logits = model(x[part], uses)
            loss = loss + nn.functional.cross_entropy(logits, y[part], reduction="sum")
            start += n
        (loss / sum(case.batches)).backward()
        if case.clip is not None:
            nn.utils.clip_grad_norm_(model.trained(), case.clip)
        opt.step()
        if sched is not None:
            sched.step()
        if ema is not None:
            ema.update_parameters(model)
        opt.zero_grad()
    return state(model, ema)


def run(case: Case, linked: dict[int, list[int]] | None = None
        ) -> list[dict[str, torch.Tensor]]:
    """Every rank's final state; `linked`: each rank's peers it had connections to."""
    store, job = dist.HashStore(), f"ranks{next(_jobs)}"
    world = len(case.batches)
    models = [Net(case) for _ in range(world)]  # here: seeding is not per thread
    if case.scrambled:
        with torch.no_grad():
            for rank, model in enumerate(models):
                for p in model.trained():
                    p.add_(rank)
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]

    def body(rank: int) -> None:
        states[rank] = train_rank(case, rank, models[rank], store, job, linked)

    on_every_rank(world, body)
    return states


def check_replicas(case: Case, states: list[dict[str, torch.Tensor]]) -> None:
    """The replicas are equal, and within a summation order of plain PyTorch."""
    for state in states[1:]:
        for name, value in states[0].items():
            assert torch.equal(value, state[name]), f"{case}: replicas differ in {name}"
    tolerance = 1e-5 if case.dtype == torch.float32 else 1e-9  # another summation order
    for name, value in reference(case).items():
        if not value.is_floating_point():  # a count (the EMA's)
            assert torch.equal(states[0][name], value), f"{case}: {name} differs"
            continue
        error = float((states[0][name] - value).norm() / value.norm().clamp_min(1e-30))
        assert error <= tolerance, f"{case}: {name} is {error:.2e} off plain PyTorch"


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_replicas_match_each_other_and_plain_pytorch_on_the_whole_batch(case: Case) -> None:
    check_replicas(case, run(case))


# Four ranks: around the ring, and in two leaves (each rank linked to its leaf's other rank
# and to the rank at its place in the other leaf).
SPARSE = [("ring", None, [[1, 3], [0, 2], [1, 3], [0, 2]]),
          ("flat", (0, 0, 1, 1), [[1, 2], [0, 3], [0, 3], [1, 2]])]


def test_over_two_planes_rank_0_s_state_arrives_whole_and_replicas_train_as_one() -> None:
    """Two addresses a rank (two NICs): rank 0's state is copied in 4 KiB pieces, every
    other piece on the second plane, and the chunks spread over both; every rank starts
    from other weights, so a piece lost or misplaced would show in the replicas."""
    case = Case(widths=(6, 200, 5), twice=False, unused=False, dtype=torch.float64,
                optimizer="sgd", overlap=True, layout="fine", exchange="flat",
                batches=(2, 3, 1), steps=3, scrambled=True, planes=2, chunk_bytes=4096)
    check_replicas(case, run(case))


@pytest.mark.parametrize(("exchange", "leaves", "peers"), SPARSE)
def test_ranks_connect_only_to_the_ranks_their_exchange_sends_to(
        exchange: str, leaves: tuple[int, ...] | None, peers: list[list[int]]) -> None:
    """The state broadcast and every chunk then travel those connections alone."""
    case = Case(widths=(6, 40, 5), twice=True, unused=False, dtype=torch.float64,
                optimizer="adamw", overlap=True, layout="fine", exchange=exchange,
                batches=(2, 1, 3, 2), steps=3, branch=(False, True, False, False),
                leaves=leaves, scrambled=True)
    linked: dict[int, list[int]] = {}
    check_replicas(case, run(case, linked))
    assert [linked[r] for r in range(4)] == peers


def test_sixteen_ranks_on_four_hosts_connect_to_host_mates_and_their_place_elsewhere() -> None:
    """Reduced within hosts first: 6 peers a rank, not 15; rank 0's state reaches every
    rank through host leaders."""
    hosts = tuple(r // 4 for r in range(16))
    case = Case(widths=(5, 24, 3), twice=False, unused=False, dtype=torch.float64,
                optimizer="sgd", overlap=True, layout="fine", exchange="auto",
                batches=tuple(1 + r % 3 for r in range(16)), steps=2, scrambled=True,
                hosts=hosts)
    linked: dict[int, list[int]] = {}
    check_replicas(case, run(case, linked))
    for rank in range(16):
        mates = {r for r in range(16) if hosts[r] == hosts[rank]}
        place = {r for r in range(16) if r % 4 == rank % 4}
        assert set(linked[rank]) == (mates | place) - {rank}, (rank, linked[rank])


@pytest.mark.parametrize("exchange", ["flat", "ring"])
def test_an_average_of_the_weights_kept_after_each_step_is_plain_pytorchs(
        exchange: str) -> None:
    """An AveragedModel (EMA) started from a deep copy of the attached model and updated
    right after every ``optimizer.step()``: each weight it reads waits for its layer's
    averages and update, on every rank, so the replicas' averages are equal and where
    one process on the whole batch keeps its own."""
    case = Case(widths=(6, 40, 12, 4), twice=False, unused=False, dtype=torch.float64,
                optimizer="sgd", overlap=True, layout="fine", exchange=exchange,
                batches=(2, 3, 1), steps=4, scrambled=True, ema=True)
    states = run(case)
    assert any(name.startswith("<ema>.") for name in states[0])
    check_replicas(case, states)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_model_split_between_two_chained_optimizers_trains_as_plain_pytorch(
        overlap: bool) -> None:
    """Muon's matrices and SGD's rest (`gl.chain`), on three ranks: replicas equal, and
    where the chain steps the whole batch in one process."""
    case = Case(widths=(6, 12, 4), twice=True, unused=False, dtype=torch.float64,
                optimizer="muon+sgd", overlap=overlap, layout="fine", exchange="ring",
                batches=(2, 3, 1), steps=3, scrambled=True, schedule=True)
    check_replicas(case, run(case))


@pytest.mark.parametrize("overlap", [True, False])
def test_a_parameter_the_optimizer_has_outside_the_model_trains_as_the_models_do(
        overlap: bool) -> None:
    """A learned temperature the loss applies, in the optimizer but not in the model (a
    0-dim one): copied from rank 0 at attach, averaged, and stepped as the forward starts,
    before the loss uses it. It was never stepped at all."""
    case = Case(widths=(6, 12, 4), twice=False, unused=False, dtype=torch.float64,
                optimizer="adamw", overlap=overlap, layout="fine", exchange="flat",
                batches=(2, 3, 1), steps=3, scrambled=True, outside=True, clip=0.5)
    states = run(case)
    check_replicas(case, states)
    assert float(states[0]["<temperature>"]) != 1.5


@pytest.mark.parametrize("branch", [(True, False), (False, False)])
def test_a_layer_some_or_no_rank_used_is_stepped_as_plain_pytorch_steps_it(
    branch: tuple[bool, bool],
) -> None:
    """Used by one rank: the other's part is zero. Used by none (and `spare`, never
    called): no gradient at all, so AdamW leaves it alone (no weight decay), as plain
    PyTorch and DDP do; a zero gradient would decay it."""
    case = Case(widths=(6, 8, 3), twice=False, unused=True, dtype=torch.float64,
                optimizer="adamw", overlap=True, layout="fine", exchange="flat",
                batches=(2, 3), steps=3, branch=branch)
    states = run(case)
    ref = reference(case)
    assert torch.equal(ref["spare.weight"], Net(case).state_dict()["spare.weight"])
    for name, value in ref.items():
        assert torch.equal(states[0][name], states[1][name]), name
        error = float((states[0][name] - value).norm() / value.norm().clamp_min(1e-30))
        assert error <= 1e-9, f"{name} is {error:.2e} off plain PyTorch"


def test_ranks_that_leave_one_after_the_other_end_identical() -> None:
    """No ``flush()``: leaving the ``with`` block applies the last step. Rank 0 leaves
    first, having sent its averages, then rank 1, then rank 2; those closing after rank 0
    still apply theirs (they used to drop them, as if rank 0 were lost, and end a step
    behind it). Each close returns once the kernels of the peers still there have all it
    sent, not when they close (it used to wait the whole 10 s linger for goodbyes that
    only come as they do)."""
    case = Case(widths=(12, 40, 5), twice=False, unused=False, dtype=torch.float64,
                optimizer="sgd", overlap=True, layout="fine", exchange="flat",
                batches=(2, 3, 1), steps=3)
    store, job, world = dist.HashStore(), f"ranks{next(_jobs)}", len(case.batches)
    models = [Net(case) for _ in range(world)]
    closed = [threading.Event() for _ in range(world)]

    def body(rank: int) -> None:
        opt, _ = optimizer(case, models[rank])
        mine = slice(sum(case.batches[:rank]), sum(case.batches[:rank + 1]))
        with gl.attach(models[rank], opt, rank=rank, world_size=world, store=store,
                       address="127.0.0.1", daemon_socket="/nonexistent/gl.sock", job=job,
                       timeout_s=30) as sync:
            for step in range(case.steps):
                x, y = batch(case, step)
                nn.functional.cross_entropy(models[rank](x[mine]), y[mine]).backward()
                opt.step()
                opt.zero_grad()
            if rank:  # 5 s: half the linger the one before would spend waiting for us
                assert closed[rank - 1].wait(5), f"rank {rank - 1}'s close waited for us"
                while rank - 1 not in sync.engine.left:  # its goodbye is in
                    time.sleep(0.01)
        closed[rank].set()

    on_every_rank(world, body)
    states = [m.state_dict() for m in models]
    check_replicas(case, states)


def test_attaching_again_meets_the_peers_afresh_whoever_comes_first() -> None:
    """Closed and attached again in the same run (to train layers unfrozen since), on a
    store that outlived the first rendezvous (torchrun's, the default process group's),
    with rank 0 the last to come: the others read the first rendezvous' addresses under
    the same keys and connected to rank 0's closed listeners ("connection refused")."""
    store, job, world = dist.HashStore(), f"ranks{next(_jobs)}", 3
    models = []
    for _ in range(world):
        torch.manual_seed(0)
        models.append(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    first = [p.detach().clone() for p in models[0].parameters()]

    def body(rank: int) -> None:
        opt = torch.optim.SGD(models[rank].parameters(), lr=0.1)
        for attach in range(3):
            if rank == 0:
                time.sleep(0.5 * attach)  # the others are at the rendezvous first
            with gl.attach(models[rank], opt, rank=rank, world_size=world, store=store,
                           address="127.0.0.1", daemon_socket="/nonexistent/gl.sock",
                           job=job, timeout_s=30):
                for step in range(2):
                    g = torch.Generator().manual_seed(10 * (2 * attach + step) + rank)
                    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
                    nn.functional.cross_entropy(models[rank](x), y).backward()
                    opt.step()
                    opt.zero_grad()

    on_every_rank(world, body)
    for rank in range(1, world):
        for a, b in zip(models[0].parameters(), models[rank].parameters(), strict=True):
            assert torch.equal(a, b), rank
    assert not all(torch.equal(a, b) for a, b in zip(first, models[0].parameters(),
                                                      strict=True))


def test_a_step_skipped_for_a_non_finite_norm_is_skipped_on_every_rank() -> None:
    """DDP's way to skip a bad step: ``if not norm.isfinite(): opt.zero_grad(); continue``.
    One rank's NaN input makes every rank's averaged norm NaN (`sync.clip_grad_norm_`);
    each skips: rank 0 with the optimizer's ``zero_grad()``, rank 1 with the model's,
    rank 2 with ``sync.skip_step()``. Every
    rank also skips a step by a rule, straight after backward, the averages still on
    their way. All end as plain PyTorch on the whole batch with those steps skipped
    (AdamW: its step count does not move). Before, the next backward raised "reached
    this model twice"."""
    store, job, world, steps, bad, ruled = dist.HashStore(), f"ranks{next(_jobs)}", 3, 6, 2, 4

    def fresh() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(4 * world, 8, generator=g)
        y = torch.randint(0, 3, (4 * world,), generator=g)
        if step == bad:
            x[5] = float("nan")  # in rank 1's slice
        return x, y

    ref = fresh()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for step in range(steps):
        x, y = data(step)
        nn.functional.cross_entropy(ref(x), y).backward()
        if step != ruled and torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9).isfinite():
            ref_opt.step()
        ref_opt.zero_grad()
    models = [fresh() for _ in range(world)]
    skipped = [0] * world

    def body(rank: int) -> None:
        model = models[rank]
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        with gl.attach(model, opt, rank=rank, world_size=world, store=store,
                       address="127.0.0.1", daemon_socket="/nonexistent/gl.sock", job=job,
                       timeout_s=30) as sync:
            for step in range(steps):
                x, y = data(step)
                mine = slice(4 * rank, 4 * rank + 4)
                nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
                if step == ruled:  # no norm waited for: the averages are still coming
                    opt.zero_grad()
                    continue
                if not sync.clip_grad_norm_(1e9).isfinite():
                    skipped[rank] += 1
                    if rank == 0:
                        opt.zero_grad()
                    elif rank == 1:
                        model.zero_grad()
                    else:  # in place of the step, and the gradients zeroed as after one
                        sync.skip_step()
                        opt.zero_grad()
                    continue
                opt.step()
                opt.zero_grad()
        assert opt.state_dict()["state"][0]["step"] == steps - 2

    on_every_rank(world, body)
    assert skipped == [1] * world
    for rank in range(world):
        for (name, a), b in zip(ref.named_parameters(), models[rank].parameters(), strict=True):
            assert float((b - a).detach().norm() / a.detach().norm()) <= 1e-6, (rank, name)


def test_two_models_of_one_job_each_attached_train_as_plain_pytorch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A generator and a discriminator, each with its optimizer and its Sync: without a
    job= each, the second is the job's name with ``#2`` on every rank (they rendezvoused
    under one name before: "rank 1's model differs from rank 0's"). Both replicas end as
    one process on the whole batch."""
    job = f"127.0.0.1:{29000 + next(_jobs)}"  # the job's default name: its rendezvous
    monkeypatch.setenv("MASTER_ADDR", job.split(":")[0])
    monkeypatch.setenv("MASTER_PORT", job.split(":")[1])
    world, steps = 2, 3

    def models() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        return (nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 4)).double(),
                nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1)).double())

    def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return (torch.randn(4 * world, 4, generator=g, dtype=torch.float64),
                torch.randn(4 * world, 4, generator=g, dtype=torch.float64) + 2)

    def train(gen: nn.Module, dis: nn.Module, rank: int | None, syncs: list[Any]) -> None:
        og, od = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (gen, dis))
        if rank is not None:
            syncs += [gl.attach(m, o, rank=rank, world_size=world, store=store,
                                address="127.0.0.1", daemon_socket="/nonexistent/gl.sock",
                                timeout_s=30) for m, o in ((gen, og), (dis, od))]
        mine = slice(None) if rank is None else slice(4 * rank, 4 * rank + 4)
        for step in range(steps):
            z, real = (t[mine] for t in data(step))
            loss = nn.functional.softplus(-dis(real)).mean()
            (loss + nn.functional.softplus(dis(gen(z).detach())).mean()).backward()
            od.step()
            od.zero_grad()
            dis.requires_grad_(False)
            nn.functional.softplus(-dis(gen(z))).mean().backward()
            dis.requires_grad_(True)
            og.step()
            og.zero_grad()
        for sync in syncs:
            sync.close()

    store = dist.HashStore()
    replicas = [models() for _ in range(world)]
    syncs: list[list[Any]] = [[] for _ in range(world)]
    on_every_rank(world, lambda rank: train(*replicas[rank], rank, syncs[rank]))
    assert [[s.config.job for s in mine] for mine in syncs] == [[job, f"{job}#2"]] * world
    ref = models()
    train(*ref, None, [])
    for m, r in zip((*replicas[0], *replicas[1]), (*ref, *ref), strict=True):
        for (name, a), b in zip(r.state_dict().items(), m.state_dict().values(), strict=True):
            error = float((a - b).norm() / a.norm().clamp_min(1e-30))
            assert error <= 1e-9, f"{name} is {error:.2e} off plain PyTorch"
    # Named by the user, one name for two models is a mistake to say.
    gen, dis = models()
    kwargs = {"rank": 0, "world_size": 1, "store": dist.HashStore(), "address": "127.0.0.1",
              "daemon_socket": "/nonexistent/gl.sock", "job": "mine"}
    with gl.attach(dis, torch.optim.SGD(dis.parameters(), lr=0.1), **kwargs), \
            pytest.raises(ConfigError, match="job 'mine' has an open Sync as rank 0 in this"):
        gl.attach(gen, torch.optim.SGD(gen.parameters(), lr=0.1), **kwargs)


class HalvingSGD(torch.optim.Optimizer):
    """Outside torch.optim, and it writes its gradients (halves them) before using them."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)
                    p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("exchange", ["flat", "ring"])
def test_an_optimizer_that_writes_its_gradients_keeps_replicas_identical(exchange: str) -> None:
    """Stepped whole-model after every average is in, and only once this rank's copies
    of them have left: a peer must not receive halved bytes."""
    OPTIMIZERS["halving"] = lambda p: HalvingSGD(p, lr=0.1)
    try:
        case = Case(widths=(40, 120, 30), twice=False, unused=False, dtype=torch.float64,
                    optimizer="halving", overlap=True, layout="fine", exchange=exchange,
                    batches=(2, 3, 1), steps=20)
        states = run(case)
        ref = reference(case)
    finally:
        del OPTIMIZERS["halving"]
    for name, value in ref.items():
        assert all(torch.equal(states[0][name], s[name]) for s in states[1:]), name
        error = float((states[0][name] - value).norm() / value.norm().clamp_min(1e-30))
        assert error <= 1e-9, f"{name} is {error:.2e} off plain PyTorch"


@pytest.mark.parametrize(("mine", "agreed"), [((3, 5, 2), 10), ((3, None, 2), None)])
def test_the_global_batch_is_agreed_only_when_every_rank_knows_its_own(
    mine: tuple[int | None, ...], agreed: int | None
) -> None:
    """A rank that cannot count its samples (a DDP hook without `samples`) keeps the job
    from stating one: the control plane would otherwise split a count of steps."""
    store, job = dist.HashStore(), f"ranks{next(_jobs)}"
    got: list[int | None] = [0] * len(mine)

    def body(rank: int) -> None:
        got[rank] = agree_batch(store, job, rank, len(mine), mine[rank])

    on_every_rank(len(mine), body)
    assert got == [agreed] * len(mine)


# Each rank's (leaf, its gradlaned's name for its host, address) and the exchange; the
# (leaves, hosts) every rank agrees on.
GROUPINGS = [
    # Pods: each rank its own address, two gradlaneds naming two hosts.
    ([(None, "boot/1", "10.0.0.1"), (None, "boot/1", "10.0.0.2"),
      (None, "boot/2", "10.0.0.3"), (None, "boot/2", "10.0.0.4")], "auto", (None, (0, 0, 1, 1))),
    # No daemon: the listening addresses.
    ([(None, None, "10.0.0.1"), (None, None, "10.0.0.2"), (None, None, "10.0.0.1")], "flat",
     (None, (0, 1, 0))),
    # Rank 1's daemon did not answer in time: its address still puts it with rank 0, and
    # rank 2's name with rank 0's (one host, two addresses).
    ([(None, "boot/1", "10.0.0.1"), (None, None, "10.0.0.1"), (None, "boot/1", "10.0.0.9"),
      (None, "boot/2", "10.0.0.3")], "auto", (None, (0, 0, 0, 1))),
    ([(None, "boot/1", "10.0.0.1"), (None, "boot/1", "10.0.0.2"),
      (None, "boot/2", "10.0.0.3"), (None, "boot/2", "10.0.0.4")], "ring",
     (None, None)),  # asked for the ring
    ([(0, None, "a"), (0, None, "b"), (1, None, "c"), (1, None, "d")], "auto",
     ((0, 0, 1, 1), None)),  # leaves only
    ([(0, None, "a"), (None, None, "a"), (1, None, "b"), (1, None, "b")], "auto",
     (None, (0, 0, 1, 1))),  # a leaf unknown
    ([(0, None, "a"), (0, None, "a"), (0, None, "b"), (1, None, "c")], "auto",
     ((0, 0, 0, 1), (0, 0, 1, 2))),  # both
    ([(3, "boot/1", "a")] * 3, "auto", (None, None)),  # one leaf, one host: nothing to group
]


@pytest.mark.parametrize(("where", "exchange", "agreed"), GROUPINGS)
def test_the_ranks_agree_on_the_groups_they_reduce_within_first(
    where: list[tuple[int | None, str | None, str]], exchange: str,
    agreed: tuple[tuple[int, ...] | None, tuple[int, ...] | None],
) -> None:
    store, job = dist.HashStore(), f"ranks{next(_jobs)}"
    got: list[object] = [None] * len(where)

    def body(rank: int) -> None:
        leaf, host, address = where[rank]
        got[rank] = reduction_groups(store, job, rank, len(where), leaf, host, address,
                                     exchange)

    on_every_rank(len(where), body)
    assert got == [agreed] * len(where)


@given(st.lists(st.tuples(st.one_of(st.none(), st.sampled_from("xyz")), st.sampled_from("abcd")),
                min_size=1, max_size=10))
def test_ranks_share_a_host_by_name_or_address_and_through_a_third(
    ranks: list[tuple[str | None, str]],
) -> None:
    names, addresses = [n for n, _ in ranks], [a for _, a in ranks]
    got = same_host(names, addresses)
    for r, host in enumerate(got):
        assert host <= r and got[host] == host  # the lowest rank of the host names it
    for r in range(len(ranks)):
        for q in range(len(ranks)):
            linked = addresses[r] == addresses[q] or (names[r] is not None
                                                      and names[r] == names[q])
            assert not linked or got[r] == got[q]
    # No host joins ranks that nothing links: each host's ranks are connected through
    # shared names or addresses (a walk from its lowest rank reaches them all).
    for host in set(got):
        members = {r for r, h in enumerate(got) if h == host}
        reached, frontier = {host}, [host]
        while frontier:
            r = frontier.pop()
            for q in members - reached:
                if addresses[q] == addresses[r] or (names[q] is not None
                                                    and names[q] == names[r]):
                    reached.add(q)
                    frontier.append(q)
        assert reached == members


def test_the_ranks_take_the_plans_chunk_owners_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0's daemon passes on a plan whose owners put every chunk on the last rank
    (a plan of the wrong length comes first, and is ignored). At the next check every
    rank regroups with those owners, and training stays exact."""
    monkeypatch.setattr(sync_module, "OWNERS_EVERY", 4)
    case = Case(widths=(40, 120, 30), twice=False, unused=False, dtype=torch.float64,
                optimizer="sgd", overlap=True, layout="fine", exchange="flat",
                batches=(2, 3, 1), steps=12)
    store, job, world = dist.HashStore(), f"ranks{next(_jobs)}", len(case.batches)
    models = [Net(case) for _ in range(world)]
    owners: list[list[tuple[int, ...]]] = [[] for _ in range(world)]
    states: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]

    def body(rank: int) -> None:
        model, (opt, _) = models[rank], optimizer(case, models[rank])
        start = sum(case.batches[:rank])
        with gl.attach(model, opt, rank=rank, world_size=world, store=store,
                       address=f"127.0.0.{1 + (case.hosts[rank] if case.hosts else 0)}",
                   daemon_socket="/nonexistent/gl.sock", job=job,
                       timeout_s=30, layout="fine") as sync:
            for step in range(case.steps):
                x, y = batch(case, step)
                mine = slice(start, start + case.batches[rank])
                nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
                opt.step()
                opt.zero_grad()
                chunks = tuple(c.owner for g in sync._groups for c in g.chunks)
                owners[rank].append(chunks)
                if rank == 0 and step in (1, 5):  # what gradlaned passes on from a plan
                    advised = [world - 1] * (len(chunks) + (1 if step == 1 else 0))
                    sync.client._handle({"type": "plan", "version": step, "bands": None,
                                         "batch_share": None, "ownership": advised})
            sync.flush()
            assert sync.owners_taken_at == 8
            assert sync.owned_bytes()[:-1] == [0] * (world - 1)
        states[rank] = {k: v.clone() for k, v in model.state_dict().items()}

    on_every_rank(world, body)
    # Rank 0 deletes each check's key at the next one: the store does not grow with steps.
    keys = f"gradlane/{job}/attempt0/0/owners"  # the job's first rendezvous in this process
    assert [store.check([f"{keys}/{s}"]) for s in (4, 8)] == [False, True]
    last = (world - 1,) * len(owners[0][0])
    for rank in range(world):
        # Steps 4 and 8 began with a check: the first plan's length did not fit; the second did.
        assert owners[rank][:8] == [owners[0][0]] * 8, rank
        assert owners[rank][8:] == [last] * 4, rank
    assert owners[0][0] != last  # balanced at first
    ref = reference(case)
    for name, value in ref.items():
        assert all(torch.equal(states[0][name], s[name]) for s in states[1:]), name
        error = float((states[0][name] - value).norm() / value.norm().clamp_min(1e-30))
        assert error <= 1e-9, f"{name} is {error:.2e} off plain PyTorch"


def test_every_rank_s_post_is_read_in_one_request_each_waited_for() -> None:
    """`get_all` (every gather of the rendezvous): the keys' values in order, a key not
    yet posted waited for, the store's timeout kept; a store without ``multi_get``
    read key by key."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=10))
    store.set("post/0", "a")

    class Counted:  # the store, each request counted
        def __init__(self) -> None:
            self.requests: list[str] = []

        def get(self, key: str) -> bytes:
            self.requests.append("get")
            return store.get(key)

        def multi_get(self, keys: list[str]) -> list[bytes]:
            self.requests.append("multi_get")
            return store.multi_get(keys)

    counted = Counted()
    later = threading.Timer(0.2, store.set, ("post/1", "b"))
    later.start()
    assert get_all(counted, ["post/0", "post/1"]) == [b"a", b"b"]  # type: ignore[arg-type]
    assert counted.requests == ["multi_get"]
    later.join()
    store.set_timeout(datetime.timedelta(seconds=0.2))
    with pytest.raises(RuntimeError):  # torch's DistStoreError
        get_all(store, ["post/0", "post/2"])

    class Plain:  # `Store`'s set and get only
        def __init__(self) -> None:
            self.values: dict[str, bytes] = {}

        def set(self, key: str, value: str) -> None:
            self.values[key] = value.encode()

        def get(self, key: str) -> bytes:
            return self.values[key]

    plain = Plain()
    plain.set("x", "1")
    plain.set("y", "2")
    assert get_all(plain, ["y", "x"]) == [b"2", b"1"]  # type: ignore[arg-type]
