"""``python -m gradlane.testbed.nsexec NAMESPACE [--parent PID] -- ARGV...``: exec ARGV
inside a namespace (with ``--parent``, ending with process PID: `end_with_parent`).

The testbed starts every in-host process through this, so it never shells out
to ``ip netns exec`` and never runs code between fork and exec.
"""

from __future__ import annotations

import os
import sys

from gradlane.signals import end_with_parent
from gradlane.testbed.netns import enter

USAGE = "usage: python -m gradlane.testbed.nsexec NAMESPACE [--parent PID] -- ARGV..."


def main(args: list[str]) -> None:
    parent = None
    if len(args) >= 3 and args[1] == "--parent":
        if not args[2].isdigit():
            sys.exit(USAGE)
        parent, args = int(args[2]), [args[0], *args[3:]]
    if len(args) < 3 or args[1] != "--":
        sys.exit(USAGE)
    if parent is not None:
        end_with_parent(parent)
    enter(args[0])
    try:
        os.execvp(args[2], args[2:])
    except OSError as exc:
        sys.exit(f"cannot run {args[2]!r} in {args[0]}: {exc.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
