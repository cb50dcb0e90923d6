"""PyTorch integration: layer-wise gradient sync over gradlane's transport.

    import gradlane.shim as gl
    sync = gl.attach(model, optimizer)   # torchrun's RANK, WORLD_SIZE, MASTER_ADDR/PORT
    ...                                  # the usual loop: backward, step, zero_grad
    sync.close()

See `gradlane.shim.sync` for what happens underneath and `ShimConfig` for the
options. `chain` makes one optimizer of several (a model split between Muon and
AdamW) for `attach`, which steps one. `comm_hook` (with `HookState`) is the DDP
communication hook for users who keep DDP: priority and chunking, but no
cross-iteration overlap.
"""

from gradlane.shim.chain import Chain, chain
from gradlane.shim.config import ShimConfig
from gradlane.shim.ddp import HookState, comm_hook
from gradlane.shim.sync import PER_PARAMETER_OPTIMIZERS, Sync, attach

__all__ = ["PER_PARAMETER_OPTIMIZERS", "Chain", "HookState", "ShimConfig", "Sync", "attach",
           "chain", "comm_hook"]
