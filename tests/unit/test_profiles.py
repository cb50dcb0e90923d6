"""The shipped model profiles: consistent data, the published sizes, and gpt2's provenance."""

from __future__ import annotations

import importlib.util
import json
from importlib import resources

import pytest

from gradlane.errors import ConfigError
from gradlane.policies.profiles import NAMES, load_profile, trace_spec
from tests import REPO

# Parameter counts as the architectures' sources state them.
PUBLISHED_PARAMS = {
    "resnet50": 25_557_032,
    "vgg19": 143_667_240,
    "bert_base": 110_106_428,
    "gpt2": 124_439_808,
}


@pytest.mark.parametrize("name", NAMES)
def test_profile_is_consistent_and_has_the_published_size(name: str) -> None:
    raw = json.loads(resources.files("gradlane.policies.profiles").joinpath(f"{name}.json")
                     .read_text())
    profile = load_profile(name)
    assert [m.index for m in profile.modules] == list(range(len(profile.modules)))
    assert all(m.bytes == 4 * m.params for m in profile.modules)
    assert sum(m.params for m in profile.modules) == raw["total_params"]
    assert raw["total_params"] == PUBLISHED_PARAMS[name]
    assert profile.total_bytes == raw["total_bytes_fp32"]
    assert profile.total_flops == raw["total_forward_flops"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_compute_times_add_up_and_backward_is_twice_forward(name: str) -> None:
    times = load_profile(name).compute_times(0.05)
    assert sum(f for f, _ in times) == pytest.approx(0.05)
    assert sum(b for _, b in times) == pytest.approx(0.10)
    spec = trace_spec(name, 10, 0.05)
    assert sum(4 * n for n, _, _ in spec) == pytest.approx(10 * (1 << 20), rel=0.02)


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="gpt2"):
        load_profile("alexnet")


def test_shipped_gpt2_profile_is_what_its_script_makes() -> None:
    script = REPO / "scripts/profile_gpt2.py"
    spec = importlib.util.spec_from_file_location("profile_gpt2", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shipped = json.loads(resources.files("gradlane.policies.profiles").joinpath("gpt2.json")
                         .read_text())
    assert module.profile() == shipped
