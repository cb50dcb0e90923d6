"""Several ranks of one job as threads of the test process (the shim's in-process tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def on_every_rank(world: int, body: Callable[[int], None], timeout_s: float = 60) -> None:
    """Run ``body(rank)`` for every rank at once; re-raise the first error here."""
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            body(rank)
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank did not finish in time"
