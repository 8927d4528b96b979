"""docker-compose.yml, read (no Docker engine here): one image, scalable workers, and a
Redis configured not to lose locks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


def _services() -> dict[str, Any]:
    spec = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert isinstance(spec, dict)
    services = spec["services"]
    assert isinstance(services, dict)
    return services


def test_one_image_is_built_once_and_run_by_every_app_service() -> None:
    services = _services()
    app = {name: s for name, s in services.items() if name != "redis"}
    builders = [name for name, s in app.items() if "build" in s]
    assert builders == ["worker"], builders
    images = {s.get("image") for s in app.values()}
    assert len(images) == 1 and None not in images, images
    for name, service in app.items():
        if name != "worker":
            assert service.get("pull_policy") == "never", name


def test_workers_scale() -> None:
    worker = _services()["worker"]
    # --scale worker=N needs containers without a fixed name or host port
    assert "container_name" not in worker
    assert "ports" not in worker
    assert "hostname" not in worker


def test_redis_never_evicts_and_persists() -> None:
    redis_service = _services()["redis"]
    command = redis_service["command"]
    text = " ".join(command) if isinstance(command, list) else command
    assert "--maxmemory-policy noeviction" in text
    assert "--appendonly yes" in text
    assert any(str(v).endswith(":/data") for v in redis_service.get("volumes", []))
