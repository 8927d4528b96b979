"""Every snippet of docs/deployments.md runs against a server of the suite.

A snippet is the ``python`` block after ``<!-- snippet: NAME -->``.  Its host names
and ports are replaced by those of the test's servers (each replacement must find its
text, so a snippet that changes fails here instead of silently testing nothing); it
runs in a fresh namespace, prints the fence its locked task got, and the lock's fence
counter on the target server must say that hold was released by its owner (fence + 1).
The server settings block must be accepted by a redis-server.
"""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis
from servers import SentinelGroup

from celery_dlock.ops.embedded import EmbeddedRedis

DOC = Path(__file__).resolve().parents[2] / "docs" / "deployments.md"
FENCE_KEY = "dlock:{stock:42}:fence"


def snippets() -> dict[str, str]:
    found = re.findall(r"<!-- snippet: (\w+) -->\s*```python\n(.*?)```", DOC.read_text(),
                       re.DOTALL)
    return dict(found)


def test_every_snippet_is_tested():
    assert set(snippets()) == {"single", "tls", "unix", "cluster", "cluster_client",
                               "sentinel", "sentinel_broker", "redlock"}


def _run(name: str, replacements: dict[str, str]) -> int:
    code = snippets()[name]
    for old, new in replacements.items():
        assert old in code, f"snippet {name} no longer has {old!r}"
        code = code.replace(old, new)
    out = io.StringIO()
    namespace: dict[str, Any] = {"__name__": f"doc_snippet_{name}"}
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"{DOC.name}:{name}", "exec"), namespace)
    app = namespace.get("app")
    if app is not None:
        app.close()
    return int(out.getvalue().strip().splitlines()[-1])


def _check(fence: int, counter: Callable[[], Any]) -> None:
    assert fence >= 1
    assert int(counter()) == fence + 1  # the task's final release left it there


@pytest.fixture(scope="module")
def doc_sentinels() -> Iterator[SentinelGroup]:
    group = SentinelGroup("mymaster", replicas=0, sentinels=3, password="redis-secret",
                          sentinel_password="sentinel-secret")
    try:
        group.start()
    except RuntimeError as exc:
        pytest.skip(f"could not start a Sentinel group with this redis-server: {exc}")
    yield group
    group.stop()


def _hostport(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port}"


def test_single_server(redis_url):
    if urlsplit(redis_url).password:
        pytest.skip("the snippet's URL has no password; DLOCK_TEST_REDIS_URL has one")
    fence = _run("single", {"redis.internal:6379": _hostport(redis_url)})
    parts = urlsplit(redis_url)
    client = redis.Redis(host=parts.hostname or "127.0.0.1", port=parts.port or 6379,
                         db=1)
    _check(fence, lambda: client.get(FENCE_KEY))
    client.close()


def test_tls(tls):
    fence = _run("tls", {"redis.internal:6380": f"127.0.0.1:{tls.port}",
                         "/etc/ssl/redis-ca.pem": tls.ca})
    client = redis.Redis.from_url(tls.plain)
    _check(fence, lambda: client.get(FENCE_KEY))
    client.close()


def test_unix_socket(unix_server: EmbeddedRedis):
    path = unix_server.unix_socket_path
    assert path is not None
    fence = _run("unix", {"/run/redis/redis.sock": path})
    client = redis.Redis.from_url(unix_server.url)
    _check(fence, lambda: client.get(FENCE_KEY))
    client.close()


@pytest.mark.parametrize("name", ["cluster", "cluster_client"])
def test_cluster(name, cluster, cluster_client):
    port = cluster.servers[1].port
    replacements = ({"redis-node-1:7000": f"127.0.0.1:{port}"} if name == "cluster"
                    else {'host="redis-node-1", port=7000':
                          f'host="127.0.0.1", port={port}'})
    fence = _run(name, replacements)
    _check(fence, lambda: cluster_client.get(FENCE_KEY))


@pytest.mark.parametrize("name", ["sentinel", "sentinel_broker"])
def test_sentinel(name, doc_sentinels):
    replacements = {f"sentinel-{i + 1}:26379": f"127.0.0.1:{s.port}"
                    for i, s in enumerate(doc_sentinels.sentinels)}
    fence = _run(name, replacements)
    client = doc_sentinels.master.client()
    _check(fence, lambda: client.get(FENCE_KEY))
    client.close()


def test_the_server_settings_are_accepted():
    block = re.search(r"<!-- redis-conf -->\s*```text\n(.*?)```", DOC.read_text(),
                      re.DOTALL)
    assert block
    args: list[str] = []
    for line in block.group(1).strip().splitlines():
        key, value = line.split(None, 1)
        args += [f"--{key}", value]
    with EmbeddedRedis(extra_args=tuple(args)) as server:
        client = redis.Redis.from_url(server.url)
        config = client.config_get("maxmemory-policy") | client.config_get("appendonly")
        client.close()
    assert config == {"maxmemory-policy": "noeviction", "appendonly": "yes"}
