"""``celery-dlock`` / ``python -m celery_dlock``: the demo, and a pointer to the CLI."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from . import __version__
from .ops.demo import main as demo_main
from .ops.oneline import mask_secrets

USAGE = """usage: celery-dlock COMMAND [options]

commands:
  demo      sell 200 units to 400 concurrent buyers on real workers, with and
            without LockedTask (starts its own redis-server unless --redis-url)
  version   print the version

To list, inspect and release held locks of your app: celery -A proj dlock --help
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0
    command, rest = args[0], args[1:]
    if command == "demo":
        return demo_main(rest)
    if command in ("version", "--version"):
        sys.stdout.write(f"celery-dlock {__version__}\n")
        return 0
    sys.stderr.write(f"celery-dlock: unknown command {mask_secrets(repr(command))} "
                     "(commands: demo, version; see celery-dlock --help)\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
