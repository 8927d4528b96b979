"""The operators' page on every lock store, over HTTP (no browser): Redis, PostgreSQL,
MariaDB and ZooKeeper servers of the suite.  A held lock is listed with its holder and
has its page; a release needs the CSRF token of the page's own form and the operator's
token, frees that hold, and its holder is told the reason; tabs follow what the
backend keeps (no queue-marker tab where it keeps none)."""

from __future__ import annotations

import html
import io
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any
from urllib.parse import urlencode
from wsgiref.util import setup_testing_defaults

import pytest
import redis
from celery import Celery
from config_app import ENV_CONF
from dlock_helpers import release_if_held

from celery_dlock import lock_from_url
from celery_dlock.core.lock_options import LockOptions
from celery_dlock.ops.target import Target
from celery_dlock.ops.web import make_app
from celery_dlock.ops.web.html import query
from celery_dlock.ops.web.snapshot import Snapshot
from celery_dlock.task.backend import backend_from_url

TOKEN = "backend-token"
HOLDER = {"task_name": "shop.reduce_stock", "task_id": "holder-task-1",
          "worker": "celery@worker-9"}


@pytest.fixture(params=["redis", "postgres", "mysql", "zookeeper"])
def store_url(request: pytest.FixtureRequest) -> str:
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_server").url)
    if request.param == "mysql":
        return str(request.getfixturevalue("mariadb_url"))
    return str(request.getfixturevalue("zk_server").url)


class Client:
    """An HTTP client with cookies, as a browser keeps them."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPCookieProcessor(CookieJar()))

    def get(self, path: str) -> tuple[int, str]:
        return self._open(urllib.request.Request(self.base + path))

    def post(self, path: str, fields: dict[str, Any]) -> tuple[int, str]:
        data = urlencode(fields).encode()
        return self._open(urllib.request.Request(self.base + path, data=data))

    def _open(self, request: urllib.request.Request) -> tuple[int, str]:
        try:
            with self.opener.open(request, timeout=30) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()


def test_list_show_and_release_on_every_store(store_url, web_prefix, serve_page,
                                              caplog):
    lock = lock_from_url(store_url, "stock:42", ttl=60, prefix=web_prefix,
                         info=HOLDER)
    assert lock.acquire(blocking=False)
    try:
        page = serve_page(store_url, web_prefix, token=TOKEN)
        client = Client(page.url)
        status, body = client.get("locks")
        assert status == 200
        assert "stock:42" in body and "holder-task-1" in body
        assert "celery@worker-9" in body
        has_markers = getattr(backend_from_url(store_url), "markers", None) is not None
        assert ('href="queued"' in body) == has_markers
        for tab in ("semaphores", "summary", *(["queued"] if has_markers else [])):
            assert client.get(tab)[0] == 200, tab
        assert client.get("queued")[0] == (200 if has_markers else 404)
        # filtered by task and by name
        assert "stock:42" in client.get("locks?task=holder-task")[1]
        assert "stock:42" not in client.get("locks?name=other")[1]

        status, body = client.get("lock?" + query(name="stock:42"))
        assert status == 200 and str(lock.fence) in body

        status, body = client.get("release?" + query(name="stock:42", fence=lock.fence))
        assert status == 200 and "Release this hold" in body
        [csrf] = re.findall(r'name="csrf" value="([0-9a-f]+)"', body)
        form = {"key": "stock%3A42", "fence": lock.fence, "reason": "stuck <job>",
                "token": TOKEN}
        # no CSRF token, a wrong one, a wrong operator's token: nothing freed
        assert client.post("release", form)[0] == 403
        assert client.post("release", {**form, "csrf": "0" * 64})[0] == 403
        assert client.post("release", {**form, "csrf": csrf, "token": "nope"})[0] == 403
        assert lock.owned()
        with caplog.at_level(logging.WARNING, logger="celery_dlock.audit"):
            status, body = client.post("release", {**form, "csrf": csrf})
        assert status == 200, body
        # the audit log line, as the command writes it
        [line] = [r.getMessage() for r in caplog.records
                  if r.name == "celery_dlock.audit"]
        assert "'stock:42' released by" in line and "celery dlock web" in line
        assert "stuck <job>" in line and "holder-task-1" in line
        assert "Released stock:42" in body and "stuck &lt;job&gt;" in body
        assert not lock.owned()
        deadline = time.monotonic() + 10
        while lock.lost_reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lock.lost_reason is not None
        if store_url.startswith("zookeeper"):
            # a ZooKeeper holder learns its node is gone, not who removed it
            # (docs/backends.md); the audit log line has the reason
            assert "released by force" in lock.lost_reason
        else:
            assert "stuck <job>" in lock.lost_reason
        assert "stock:42" not in client.get("locks")[1].split("<table", 1)[-1]
        # the summary: the release is in the history even with contention not
        # recorded (dlock_record_events off), where the backend keeps one
        status, body = client.get("summary")
        assert status == 200
        if store_url.startswith("redis"):
            assert "stuck &lt;job&gt;" in body and "Contention is not recorded" in body
            assert "<svg" in body
        else:
            assert "keeps no event history yet" in body and "<svg" not in body
    finally:
        release_if_held(lock)


def test_a_read_only_page_refuses_every_release(redis_url, web_prefix, serve_page):
    lock = lock_from_url(redis_url, "stock:1", ttl=60, prefix=web_prefix, info=HOLDER)
    assert lock.acquire(blocking=False)
    try:
        client = Client(serve_page(redis_url, web_prefix).url)
        status, body = client.get("lock?" + query(name="stock:1"))
        assert status == 200 and "Read-only" in body and "release?" not in body
        assert client.get("release?" + query(name="stock:1", fence=lock.fence))[0] == 403
        assert client.post("release", {"key": "stock:1", "fence": lock.fence,
                                       "token": "", "csrf": ""})[0] == 403
        assert lock.owned()
    finally:
        lock.release_all()


def test_bytes_that_are_not_utf8_show_escaped(redis_url, web_prefix, serve_page):
    """A hold whose metadata another writer left as bytes that are not UTF-8 (and a
    URL password) shows, escaped, and never breaks the page."""
    url = redis_url.replace("redis://", "redis://:hunter2@") \
        if "@" not in redis_url else redis_url
    r = redis.Redis.from_url(redis_url)
    lock = lock_from_url(redis_url, "raw:1", ttl=60, prefix=web_prefix, info=HOLDER)
    assert lock.acquire(blocking=False)
    try:
        key = backend_from_url(redis_url).storage_key(web_prefix, "raw:1")
        r.hset(key, "task_name", b"\xff\xfe<i>x</i>\x1b")
        page = serve_page(redis_url, web_prefix)
        client = Client(page.url)
        for path in ("locks", "lock?" + query(name="raw:1")):
            status, body = client.get(path)
            assert status == 200
            text = html.unescape(body)
            assert "<i>x</i>" in text and "<i>x</i>" not in body
            assert "\\xff" in text or "\ufffd" in text
            assert "\x1b" not in body
        # a password in the store's URL is never shown
        masked = serve_page(url, web_prefix)
        status, body = Client(masked.url).get("locks")
        assert "hunter2" not in body
    finally:
        lock.release_all()
        r.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_the_command_serves_the_page(redis_url, web_prefix, host):
    """``celery -A app dlock web --port 0`` binds 127.0.0.1 by default and serves the
    page; on another address it warns that the page has no login of its own."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo / "tests"), str(repo)]),
               **{ENV_CONF: json.dumps({"dlock_url": redis_url,
                                        "broker_url": "memory://"})})
    env.pop("DLOCK_WEB_TOKEN", None)
    lock = lock_from_url(redis_url, "cmd:1", ttl=60, prefix=web_prefix, info=HOLDER)
    assert lock.acquire(blocking=False)
    options = [] if host == "127.0.0.1" else ["--host", host]
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "config_app", "dlock",
                             "--prefix", web_prefix, "web", "--port", "0", *options],
                            env=env, cwd=repo, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded by the test's timeout
        [port] = re.findall(rf"on http://{re.escape(host)}:(\d+)/", line)
        assert "read-only" in line
        status, body = Client(f"http://127.0.0.1:{port}/").get("")
        assert status == 200 and "cmd:1" in body and "holder-task-1" in body
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
        lock.release_all()
    assert ("no login of its own" in err) == (host != "127.0.0.1"), err


def test_mounted_under_a_path_its_links_stay_under_it(redis_url, web_prefix):
    """As a site mounts it (``SCRIPT_NAME`` /dlock): /dlock redirects to /dlock/, the
    links are relative, the cookie is the mount's."""
    app = Celery("mounted", set_as_current=False)
    app.conf.update(dlock_url=redis_url, broker_url="memory://")
    web = make_app(app, prefix=web_prefix)

    def call(path: str) -> tuple[str, dict[str, str], str]:
        environ: dict[str, Any] = {}
        setup_testing_defaults(environ)
        environ.update(SCRIPT_NAME="/dlock", PATH_INFO=path,
                       **{"wsgi.input": io.BytesIO(b"")})
        seen: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]]) -> None:
            seen["status"], seen["headers"] = status, dict(headers)

        body = b"".join(web(environ, start_response)).decode()
        return seen["status"], seen["headers"], body

    status, headers, _ = call("")
    assert status.startswith("301") and headers["Location"] == "/dlock/"
    status, headers, body = call("/")
    assert status.startswith("200")
    assert "Path=/dlock/" in headers["Set-Cookie"]
    assert 'href="locks"' in body and 'href="/' not in body
    web.target.close()


def test_a_semaphore_slot_is_released_alone_and_hashed_names_show_their_args(
        redis_url, web_prefix, serve_page):
    backend = backend_from_url(redis_url)
    slots = [backend.lock(LockOptions(
        "thumbs", 60, prefix=web_prefix, limit=3, owner=f"slot-{n}",
        info={"task_name": "media.thumb", "task_id": f"slot-task-{n}"}))
             for n in range(2)]
    hashed = backend.lock(LockOptions("a1b2c3d4", 60, prefix=web_prefix,
                          info={"task_name": "shop.sync", "task_id": "hashed-1",
                                "args": "('<b>acme</b>', 7)"}))
    for lock in (*slots, hashed):
        assert lock.acquire(blocking=False)
    try:
        client = Client(serve_page(redis_url, web_prefix, token=TOKEN).url)
        status, body = client.get("semaphores")
        assert status == 200 and "2/3" in body and "slot-task-1" in body
        status, body = client.get("locks")
        assert "&lt;b&gt;acme&lt;/b&gt;" in body and "<b>acme" not in body
        assert "&lt;b&gt;acme" in client.get("lock?" + query(name="a1b2c3d4"))[1]
        # one slot, by its fence: the other stays held
        status, body = client.get("release?" + query(name="thumbs",
                                                     fence=slots[0].fence))
        assert status == 200 and "slot-task-0" in body
        [csrf] = re.findall(r'name="csrf" value="([0-9a-f]+)"', body)
        status, body = client.post("release", {
            "key": "thumbs", "fence": slots[0].fence, "reason": "one slot",
            "token": TOKEN, "csrf": csrf})
        assert status == 200 and "Released thumbs" in body, body
        assert not slots[0].owned() and slots[1].owned()
    finally:
        for lock in (*slots, hashed):
            lock.release_all()


def test_the_holds_are_read_once_per_moment_whatever_the_pages(redis_url, web_prefix):
    """Pages within ``max_age`` share one read of the holds; a later page, or one
    after a release, reads afresh."""
    app = Celery("snap", set_as_current=False)
    app.conf.update(dlock_url=redis_url, broker_url="memory://")
    now = [100.0]
    snapshot = Snapshot(Target(app, None, web_prefix), max_age=1.0,
                        clock=lambda: now[0])
    first = lock_from_url(redis_url, "snap:1", ttl=60, prefix=web_prefix)
    second = lock_from_url(redis_url, "snap:2", ttl=60, prefix=web_prefix)
    assert first.acquire(blocking=False)
    try:
        assert [i.key for i in snapshot.holds()] == ["snap:1"]
        assert second.acquire(blocking=False)
        now[0] += 0.5
        assert [i.key for i in snapshot.holds()] == ["snap:1"]  # the same moment
        now[0] += 0.5
        assert sorted(i.key for i in snapshot.holds()) == ["snap:1", "snap:2"]
        first.release()
        snapshot.forget()
        assert [i.key for i in snapshot.holds()] == ["snap:2"]
    finally:
        first.release_all()
        second.release_all()


def test_a_store_that_does_not_answer_is_one_line_on_the_page(web_prefix, serve_page):
    """Nothing listens at the URL: every page answers 503 with one line naming the
    store (its password masked), and the page comes back when asked again."""
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"redis://:s3cr3t@127.0.0.1:{port}/0"
    client = Client(serve_page(url, web_prefix, token=TOKEN).url)
    for path in ("locks", "summary", "lock?name=x", "semaphores"):
        status, body = client.get(path)
        assert status == 503, (path, body)
        assert "Cannot read Redis" in body and f"127.0.0.1:{port}" in body
        assert "s3cr3t" not in body
