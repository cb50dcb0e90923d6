"""The policy interface: ``plan(state) -> Plan``, pure and deterministic.

This is the host-local core of the interface: what one daemon knows (its
link and the jobs with workers on it) and what it enforces (one class per
job). The policies issue extends `State` and `Plan` (coflows, topology,
ownership, batch shares) without changing the contract: a policy is a class
with one synchronous method, no I/O, same state in -> same plan out.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from gradlane.errors import ConfigError

__all__ = ["JobClassPlan", "JobState", "Plan", "Policy", "State", "get_policy", "register"]


@dataclass(frozen=True)
class JobState:
    """A job as one host sees it."""

    name: str
    workers: int  # its workers on this host
    flows: int  # their registered band connections


@dataclass(frozen=True)
class State:
    """What a policy plans from."""

    shaped_bps: int  # what the host's root class carries
    other_bps: int  # kept for non-gradlane traffic
    jobs: tuple[JobState, ...]  # sorted by name


@dataclass(frozen=True)
class JobClassPlan:
    rate_bps: int
    ceil_bps: int
    prio: int  # 0 (first) .. 7


@dataclass(frozen=True)
class Plan:
    """What the daemon enforces: one class per job, by job name."""

    job_classes: dict[str, JobClassPlan]
    source: str  # the policy's name, or "control" for a control-plane plan


class Policy(ABC):
    """A scheduling policy. Subclasses set `name` and implement `plan`.

    `plan` must be pure (no I/O, no clock, no randomness without a seed in
    the state) and total: it returns a plan for every job in the state, with
    0 < rate <= ceil <= state.shaped_bps and prio in 0..7.
    """

    name: str = ""

    @abstractmethod
    def plan(self, state: State) -> Plan:
        """Return the plan for `state`."""


_REGISTRY: dict[str, type[Policy]] = {}


def register(name: str) -> Callable[[type[Policy]], type[Policy]]:
    """Class decorator: make a policy available by `name`."""

    def add(cls: type[Policy]) -> type[Policy]:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def get_policy(name: str) -> Policy:
    """A policy by registered name, or ``"package.module:Class"`` for a third-party one.

    Raises:
        ConfigError: no such policy (never a silent default).
    """
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"policy {name!r} cannot be loaded: {exc}") from None
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise ConfigError(f"policy {name!r} is not a gradlane.policies.Policy subclass")
        return cls()
    try:
        return _REGISTRY[name]()
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ConfigError(f"unknown policy {name!r} (known: {known}, or 'module:Class')") from None
