"""Every `gradlane.<module>.<name>` that a docstring, comment or README points the reader to
exists: a function renamed or dropped leaves no reference behind that sends readers
looking for it (`agree_leaves`, gone long before a docstring stopped naming it)."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any

from tests import REPO

SOURCES = ("gradlane", "daemon", "shim", "policies", "testbed", "bench", "tests", "scripts")
REFERENCE = re.compile(r"`(gradlane(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")


def _texts() -> list[Path]:
    files = [REPO / "README.md", REPO / "bench/README.md"]
    for top in SOURCES:
        files += sorted((REPO / top).rglob("*.py"))
    return [f for f in files if f.is_file()]


def references() -> dict[str, str]:
    """Each dotted reference, with the first file (repo-relative) that makes it."""
    found: dict[str, str] = {}
    for path in _texts():
        for match in REFERENCE.finditer(path.read_text()):
            found.setdefault(match.group(1), str(path.relative_to(REPO)))
    return found


def resolves(dotted: str) -> bool:
    """The longest importable prefix is a module; the rest are attributes of it (a
    dataclass field without a default counts)."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:k]))
        except ModuleNotFoundError:
            continue
        for name in parts[k:]:
            if hasattr(obj, name):
                obj = getattr(obj, name)
            elif dataclasses.is_dataclass(obj) and name in {f.name for f in
                                                            dataclasses.fields(obj)}:
                obj = None
            else:
                return False
        return True
    return False


def test_the_scan_finds_the_references_it_is_meant_to() -> None:
    found = references()
    assert len(found) > 40  # the docs point at dozens of places
    assert "gradlane.shim.sync.pick_layout" in found
    assert resolves("gradlane.shim.ShimConfig.chunk_bytes")
    assert not resolves("gradlane.shim.transport.agree_leaves")
    assert not resolves("gradlane.nowhere.at_all")


def test_every_referenced_name_exists() -> None:
    missing = [f"{where} names {dotted}" for dotted, where in sorted(references().items())
               if not resolves(dotted)]
    assert missing == [], "no such module or name: " + "; ".join(missing)
