"""PyTorch integration (per-layer gradient sync over gradlane's transport).

Not built yet: see the shim issue. Nothing is exported so far.
"""

__all__: list[str] = []
