"""docker-compose.yml as the compose tests read it (no Docker engine here): its
services by profile, and a service's environment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = ["environment", "services"]

COMPOSE = Path(__file__).resolve().parents[1] / "docker-compose.yml"


def services(profile: str | None = None) -> dict[str, Any]:
    """The services ``docker compose up`` starts (no profile), or those of
    ``profile`` (``--profile amqp``: the stack without Redis)."""
    spec = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(spec, dict)
    found = spec["services"]
    assert isinstance(found, dict)
    return {name: s for name, s in found.items()
            if (profile in (s.get("profiles") or [])
                if profile is not None else not s.get("profiles"))}


def environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment as a mapping (compose allows a list of K=V too)."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}
