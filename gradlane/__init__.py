"""gradlane: priority lanes on the network for data-parallel training traffic.

The subpackages are `gradlane.daemon` (the per-host service and its qdisc
manager), `gradlane.shim` (the PyTorch integration), `gradlane.policies`
(pure scheduling logic) and `gradlane.testbed` (an emulated cluster built from
network namespaces).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gradlane")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
