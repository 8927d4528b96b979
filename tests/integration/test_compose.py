"""docker-compose.yml, read (no Docker engine here): one image, scalable workers, and a
Redis configured not to lose locks; the "amqp" profile's stack without Redis."""

from __future__ import annotations

from pathlib import Path

import compose_file

REPO = Path(__file__).resolve().parents[2]


def test_one_image_is_built_once_and_run_by_every_app_service() -> None:
    services = compose_file.services()
    app = {name: s for name, s in services.items() if name != "redis"}
    builders = [name for name, s in app.items() if "build" in s]
    assert builders == ["worker"], builders
    images = {s.get("image") for s in app.values()}
    assert len(images) == 1 and None not in images, images
    for name, service in app.items():
        if name != "worker":
            assert service.get("pull_policy") == "never", name


def test_workers_scale() -> None:
    worker = compose_file.services()["worker"]
    # --scale worker=N needs containers without a fixed name or host port
    assert "container_name" not in worker
    assert "ports" not in worker
    assert "hostname" not in worker


def test_redis_never_evicts_and_persists() -> None:
    redis_service = compose_file.services()["redis"]
    command = redis_service["command"]
    text = " ".join(command) if isinstance(command, list) else command
    assert "--maxmemory-policy noeviction" in text
    assert "--appendonly yes" in text
    assert any(str(v).endswith(":/data") for v in redis_service.get("volumes", []))


# -- the "amqp" profile: RabbitMQ + PostgreSQL, no Redis anywhere ---------------------


def test_the_amqp_profile_runs_without_redis() -> None:
    stack = compose_file.services("amqp")
    assert set(stack) == {"rabbitmq", "postgres", "chaos-worker", "chaos-producer"}
    for name, service in stack.items():
        assert "redis" not in (service.get("depends_on") or {}), name
        for key, value in compose_file.environment(service).items():
            assert not value.startswith(("redis://", "rediss://")), (name, key)
    worker = compose_file.environment(stack["chaos-worker"])
    assert worker["CHAOS_BROKER_URL"].startswith("amqp://")
    assert "@rabbitmq:" in worker["CHAOS_BROKER_URL"]
    assert worker["CHAOS_LOCK_URL"].startswith("postgresql://")
    assert "@postgres:" in worker["CHAOS_LOCK_URL"]
    assert compose_file.environment(stack["chaos-producer"]) == worker


def test_the_amqp_profile_builds_one_image_of_its_own() -> None:
    stack = compose_file.services("amqp")
    app = {name: s for name, s in stack.items() if name.startswith("chaos-")}
    builders = [name for name, s in app.items() if "build" in s]
    assert builders == ["chaos-worker"], builders
    build = app["chaos-worker"]["build"]
    assert build["context"] == "."
    assert build["args"]["EXTRAS"] == "postgres"  # psycopg for the lock
    assert {s["image"] for s in app.values()} == {app["chaos-worker"]["image"]}
    assert app["chaos-producer"]["pull_policy"] == "never"
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "ARG EXTRAS" in dockerfile and "COPY tests/chaos ./tests/chaos" in dockerfile
    # The files the commands run exist where the working dir puts them.
    for service, module in (("chaos-worker", "chaos_app.py"),
                            ("chaos-producer", "stack.py")):
        assert app[service]["working_dir"] == "/app/tests/chaos"
        assert (REPO / "tests" / "chaos" / module).is_file()
        command = app[service]["command"]
        text = " ".join(command) if isinstance(command, list) else command
        assert module.removesuffix(".py") in text, service
