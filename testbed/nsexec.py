"""``python -m gradlane.testbed.nsexec NAMESPACE -- ARGV...``: exec ARGV inside a namespace.

The testbed starts every in-host process through this, so it never shells out
to ``ip netns exec`` and never runs code between fork and exec.
"""

from __future__ import annotations

import os
import sys

from gradlane.testbed.netns import enter


def main(args: list[str]) -> None:
    if len(args) < 3 or args[1] != "--":
        sys.exit("usage: python -m gradlane.testbed.nsexec NAMESPACE -- ARGV...")
    enter(args[0])
    try:
        os.execvp(args[2], args[2:])
    except OSError as exc:
        sys.exit(f"cannot run {args[2]!r} in {args[0]}: {exc.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
