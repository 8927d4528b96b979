"""The operators' page in a real browser (headless Chromium) against the suite's
redis-server: a held lock shows with its holder and the page refreshes in place; a
release with the token and the confirmation frees exactly that hold and its holder is
told the reason; without the token the page is read-only and a forged POST is
refused; a hostile lock name shows as text.  Each page is also captured as a PNG (into
``$DLOCK_WEB_SCREENSHOTS`` when set: ``docs/web/`` keeps them)."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
from celery.contrib.testing.worker import start_worker
from celery_helpers import close_app, test_app

from celery_dlock import LockedTask, LockLost, RedisLock
from celery_dlock.core.lock_options import LockOptions
from celery_dlock.core.rates import Rate
from celery_dlock.ops.web.html import query
from celery_dlock.task.backend import backend_from_url
from celery_dlock.task.event_counts import count_into
from celery_dlock.task.events import Event, events_key, push_event, recent_events

pytestmark = pytest.mark.browser

TOKEN = "t0ken-" + uuid.uuid4().hex[:6]
HOLDER = {"task_name": "shop.reduce_stock", "task_id": "6f1c-holder-task",
          "worker": "celery@worker-3"}


def _wait(predicate: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not true within {timeout}s")


def test_a_held_lock_shows_with_its_holder_and_the_list_refreshes_in_place(
        redis_url, web_prefix, serve_page, browser):
    r = redis.Redis.from_url(redis_url)
    first = RedisLock(r, "stock:42", ttl=60, prefix=web_prefix, info=HOLDER)
    second = RedisLock(r, "stock:43", ttl=60, prefix=web_prefix,
                       info={"task_name": "shop.later", "task_id": "later-id"})
    assert first.acquire(blocking=False)
    try:
        page = serve_page(redis_url, web_prefix, refresh=0.5)
        browser.go(page.url)
        text = browser.text()
        assert "stock:42" in text and "shop.reduce_stock" in text
        assert "6f1c-holder-task" in text and "celery@worker-3" in text
        assert "Read-only" in text  # no token
        # taken after the page loaded: shown by the refresh, not by a reload
        browser.eval("window.__same_page = 'yes'")
        assert second.acquire(blocking=False)
        browser.wait_for("document.getElementById('live').innerText"
                         ".includes('later-id')")
        assert browser.eval("window.__same_page") == "yes"
        # one lock's page: its fields, with the fence
        browser.go(page.url + "lock?" + query(name="stock:42"))
        text = browser.text()
        assert str(first.fence) in text and "shop.reduce_stock" in text
    finally:
        first.release_all()
        second.release_all()
        r.close()


def test_a_release_with_the_token_frees_that_hold_and_tells_the_holder_why(
        redis_url, web_prefix, serve_page, browser):
    r = redis.Redis.from_url(redis_url)
    lost: list[str] = []
    lock = RedisLock(r, "invoice:7", ttl=60, prefix=web_prefix, info=HOLDER,
                     on_lost=lambda lk: lost.append(str(lk.lost_reason)))
    assert lock.acquire(blocking=False)
    try:
        page = serve_page(redis_url, web_prefix, token=TOKEN,
                          dlock_record_events=True)
        browser.go(page.url + "lock?" + query(name="invoice:7"))
        assert "Read-only" not in browser.text()
        browser.eval("document.querySelector('a[href^=\"release?\"]').click()")
        browser.wait_load()
        text = browser.text()
        # the confirmation says what will be freed
        assert "shop.reduce_stock[6f1c-holder-task]" in text
        assert str(lock.fence) in text and "Release this hold" in text
        assert lock.owned()  # nothing freed by looking
        reason = "stuck since 03:00, ticket 812"
        browser.eval(f"document.querySelector('input[name=reason]').value = "
                     f"{json.dumps(reason)}; document.querySelector("
                     f"'input[name=token]').value = {json.dumps(TOKEN)}; "
                     "document.querySelector('form[method=post] button').click()")
        browser.wait_load()
        text = browser.text()
        assert "Released invoice:7" in text, text
        assert not lock.owned()
        # the holder is told who and why
        _wait(lambda: lost)
        assert reason in lost[0] and "celery dlock web" in lost[0]
        # the audit event, as top shows it
        [event] = [e for e in recent_events(r, web_prefix) if e.kind == "released"]
        assert event.key == "invoice:7" and event.detail == reason
        assert event.holder_task_id == "6f1c-holder-task"
        # and the lock's history on its page
        browser.go(page.url + "lock?" + query(name="invoice:7"))
        assert reason in browser.text()
    finally:
        lock.release_all()
        r.delete(events_key(web_prefix), *r.keys(f"{web_prefix}:counts:*"))
        r.close()


def test_a_running_task_released_from_the_page_fails_with_the_reason(
        redis_url, web_prefix, serve_page, browser):
    """A real task on an in-process worker: the page shows it holding its lock, the
    release from the page frees it, and the task ends with LockLost saying why."""
    tag = uuid.uuid4().hex[:8]
    app = test_app(f"web{tag}", redis_url, queue=f"q-web-{tag}", prefix=web_prefix)

    @app.task(base=LockedTask, bind=True, name=f"web{tag}.nightly", lock_key="job:{x}",
              lock_ttl=3)
    def nightly(self: Any, x: str) -> str:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            self.lock.ensure_held()  # raises LockLost once released from the page
            time.sleep(0.05)
        return "never told"

    backend = backend_from_url(redis_url)
    try:
        with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                          shutdown_timeout=20):
            result = nightly.delay("7")
            _wait(lambda: backend.read(web_prefix, "job:7"), timeout=30)
            page = serve_page(redis_url, web_prefix, token=TOKEN)
            browser.go(page.url)
            text = browser.text()
            assert "job:7" in text and result.id in text and f"web{tag}.nightly" in text
            browser.go(page.url + "lock?" + query(name="job:7"))
            browser.eval("document.querySelector('a[href^=\"release?\"]').click()")
            browser.wait_load()
            assert result.id in browser.text()
            browser.eval("document.querySelector('input[name=reason]').value = "
                         "'nightly stuck on a dead replica'; document.querySelector("
                         f"'input[name=token]').value = {json.dumps(TOKEN)}; "
                         "document.querySelector('form[method=post] button').click()")
            browser.wait_load()
            assert "Released job:7" in browser.text()
            with pytest.raises(LockLost, match="nightly stuck on a dead replica"):
                result.get(timeout=30)
    finally:
        close_app(app)


def test_a_changed_hold_is_not_freed(redis_url, web_prefix, serve_page, browser):
    r = redis.Redis.from_url(redis_url)
    old = RedisLock(r, "report:1", ttl=60, prefix=web_prefix, info=HOLDER)
    new = RedisLock(r, "report:1", ttl=60, prefix=web_prefix, owner="next-owner")
    assert old.acquire(blocking=False)
    try:
        page = serve_page(redis_url, web_prefix, token=TOKEN)
        browser.go(page.url + "release?" + query(name="report:1", fence=old.fence))
        assert str(old.fence) in browser.text()
        # between the confirmation and the click, the hold changes hands
        old.release()
        assert new.acquire(blocking=False)
        browser.eval(f"document.querySelector('input[name=reason]').value = 'x'; "
                     f"document.querySelector('input[name=token]').value = "
                     f"{json.dumps(TOKEN)}; "
                     "document.querySelector('form[method=post] button').click()")
        browser.wait_load()
        assert "Nothing was released" in browser.text()
        assert new.owned()
    finally:
        old.release_all()
        new.release_all()
        r.close()


class _Attacker(BaseHTTPRequestHandler):
    """Another site: a page whose form posts to the lock page's release at once."""

    target = ""
    fields: dict[str, str] = {}
    timeout = 5  # a connection the browser opens ahead and leaves idle

    def do_GET(self) -> None:
        inputs = "".join(f'<input type=hidden name="{k}" value="{v}">'
                         for k, v in self.fields.items())
        body = (f'<form method=post action="{self.target}release">{inputs}</form>'
                "<script>document.forms[0].submit()</script>").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


@pytest.mark.parametrize("token", [None, TOKEN], ids=["read-only", "with-token"])
def test_a_forged_post_is_refused(redis_url, web_prefix, serve_page, browser, token):
    r = redis.Redis.from_url(redis_url)
    lock = RedisLock(r, "payroll:1", ttl=60, prefix=web_prefix, info=HOLDER)
    assert lock.acquire(blocking=False)
    attacker = ThreadingHTTPServer(("127.0.0.1", 0), _Attacker)
    attacker.daemon_threads = True
    thread = threading.Thread(target=attacker.serve_forever, daemon=True)
    thread.start()
    try:
        page = serve_page(redis_url, web_prefix, token=token)
        browser.go(page.url + "lock?" + query(name="payroll:1"))
        text = browser.text()
        if token is None:  # read-only, and says so: no release link, no form
            assert "Read-only" in text
            assert browser.eval("document.querySelectorAll('a[href^=\"release\"]')"
                                ".length") == 0
            browser.go(page.url + "release?" + query(name="payroll:1",
                                                     fence=lock.fence))
            assert "read-only" in browser.text()
        # the operator's browser has the page's cookie; another site posts with
        # it (even knowing the token)
        _Attacker.target = page.url
        _Attacker.fields = {"key": "payroll%3A1", "fence": str(lock.fence),
                            "token": TOKEN, "reason": "forged", "csrf": "guess"}
        browser.go(f"http://127.0.0.1:{attacker.server_port}/")
        browser.wait_for("location.pathname === '/release' && "
                         "document.readyState === 'complete'")
        assert "did not come from this page (CSRF)" in browser.text()
        assert lock.owned()
    finally:
        attacker.shutdown()
        attacker.server_close()
        lock.release_all()
        r.close()


HOSTILE = ('<script>window.__pwned=1</script>"\'><img src=x '
           'onerror="window.__pwned=2">\x07\x1b[31m&amp;')


def test_a_hostile_name_shows_as_text(redis_url, web_prefix, serve_page, browser):
    r = redis.Redis.from_url(redis_url)
    lock = RedisLock(r, HOSTILE, ttl=60, prefix=web_prefix,
                     info={"task_name": "<b>bold</b>", "task_id": "id\"'<x>"})
    assert lock.acquire(blocking=False)
    try:
        page = serve_page(redis_url, web_prefix, token=TOKEN)
        for path in ("", "lock?" + query(name=HOSTILE)):
            browser.go(page.url + path)
            text = browser.text()
            shown = HOSTILE.replace("\x07", "\\x07").replace("\x1b", "\\x1b")
            assert shown in text, text
            assert "<b>bold</b>" in text and "id\"'<x>" in text
            # no element made of the data: the page's own script only, no image
            assert browser.eval("document.scripts.length") == 1
            assert browser.eval("document.images.length") == 0
            assert browser.eval("document.querySelectorAll('b').length") == 0 \
                or "bold" not in browser.eval(
                    "[...document.querySelectorAll('b')].map(e=>e.innerText).join()")
            assert browser.eval("window.__pwned") is None
        # the link to the lock's page names it exactly
        browser.go(page.url + "lock?name=" + quote(HOSTILE, safe=""))
        assert f"Lock {shown}" in browser.text()
        # and its release frees exactly it (the form carries the name byte for byte)
        browser.eval("document.querySelector('a[href^=\"release?\"]').click()")
        browser.wait_load()
        browser.eval("document.querySelector('input[name=reason]').value = 'x'; "
                     f"document.querySelector('input[name=token]').value = "
                     f"{json.dumps(TOKEN)}; "
                     "document.querySelector('form[method=post] button').click()")
        browser.wait_load()
        assert "Released" in browser.text(), browser.text()
        assert not lock.owned()
    finally:
        lock.release_all()
        r.close()


def _populate(redis_url: str, prefix: str) -> list[Any]:
    """Locks, a semaphore, a queued call, a rate and an hour of events."""
    r = redis.Redis.from_url(redis_url)
    backend = backend_from_url(redis_url)
    held = []
    for n, (name, task) in enumerate([("stock:42", "shop.reduce_stock"),
                                      ("stock:77", "shop.reduce_stock"),
                                      ("report:2026-11-28", "reports.daily"),
                                      ("sync:crm", "crm.sync")]):
        lock = backend.lock(LockOptions(name, 300, prefix=prefix, owner=f"owner-{n}",
                            info={"task_name": task, "task_id": f"{uuid.uuid4()}",
                                  "worker": f"celery@worker-{n % 2 + 1}"}))
        assert lock.acquire(blocking=False)
        held.append(lock)
    for n in range(2):
        slot = backend.lock(LockOptions("thumbnails", 300, prefix=prefix, limit=4,
                            owner=f"slot-{n}",
                            info={"task_name": "media.thumbnail",
                                  "task_id": f"{uuid.uuid4()}",
                                  "worker": "celery@worker-2"}))
        assert slot.acquire(blocking=False)
        held.append(slot)
    markers = backend.markers()  # type: ignore[attr-defined]
    markers.claim(prefix, "email:welcome:1009", str(uuid.uuid4()), 600,
                  running_counts=False, replace=False, requeue=False)
    rates = backend.rates()  # type: ignore[attr-defined]
    for _ in range(3):
        rates.take(prefix, "api:partner", Rate(calls=1, period=10, burst=2))
    now = time.time()
    events = []
    for minute in range(0, 60, 3):
        for k in range((minute * 7) % 5):
            events.append(Event(at=now - minute * 60 - k, kind="contended",
                                key="stock:42", task_name="shop.reduce_stock",
                                task_id=str(uuid.uuid4()), worker="celery@worker-2",
                                policy="retry", holder_task_name="shop.reduce_stock",
                                holder_task_id="6f1c", holder_worker="celery@worker-1"))
        if minute % 6 == 0:
            events.append(Event(at=now - minute * 60 - 7, kind="duplicate",
                                key="email:welcome:1009", task_name="mail.welcome",
                                task_id=str(uuid.uuid4()), policy="drop",
                                holder_task_id="queued-1",
                                detail="lock_mode until_started"))
        if minute % 9 == 0:
            events.append(Event(at=now - minute * 60 - 9, kind="parked",
                                key="api:partner", task_name="partner.push",
                                task_id=str(uuid.uuid4()), worker="celery@worker-1",
                                detail="lock_rate 6/m, its slot in 8.40s"))
        if minute % 15 == 0:
            events.append(Event(at=now - minute * 60 - 5, kind="lost", key="sync:crm",
                                task_name="crm.sync", task_id=str(uuid.uuid4()),
                                worker="celery@worker-1",
                                detail="not renewed in time"))
    events.append(Event(at=now - 90, kind="released", key="report:2026-11-27",
                        worker="ops@bastion", holder_task_name="reports.daily",
                        holder_task_id="r-26", holder_worker="celery@worker-1",
                        detail="stuck after the database failover"))
    events.sort(key=lambda e: e.at)
    pipe = r.pipeline(transaction=False)
    for e in events:
        push_event(pipe, prefix, e)  # the history and each minute's count
    for minute in range(60):  # acquisitions are counted only
        for _ in range(10 + (minute * 13) % 17):
            count_into(pipe, prefix, "acquired", now - minute * 60)
    pipe.execute()
    r.close()
    return held


def test_every_page_renders_and_is_captured(redis_url, web_prefix, serve_page,
                                            browser):
    held = _populate(redis_url, web_prefix)
    out = os.environ.get("DLOCK_WEB_SCREENSHOTS")
    try:
        page = serve_page(redis_url, web_prefix, token=TOKEN,
                          dlock_record_events=True)
        shots = {
            "locks": ("locks", "shop.reduce_stock"),
            "semaphores": ("semaphores", "2/4"),
            "queued": ("queued", "email:welcome:1009"),
            "rates": ("rates", "api:partner"),
            "summary": ("summary", "parked"),
            "lock": ("lock?" + query(name="stock:42"), "History"),
            "release": ("release?" + query(name="stock:42", fence=held[0].fence),
                        "Release this hold"),
        }
        for shot, (path, expected) in shots.items():
            browser.go(page.url + path)
            assert expected in browser.text(), (shot, browser.text())
            png = browser.screenshot()
            assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
            if out:
                Path(out, f"{shot}.png").write_bytes(png)
        # the chart has a line for each kind of event, drawn by the server
        assert browser is not None
        browser.go(page.url + "summary")
        assert browser.eval("document.querySelectorAll('svg polyline').length") == 6
        assert "acquired (" in browser.text()
    finally:
        for lock in held:
            lock.release_all()
        r = redis.Redis.from_url(redis_url)
        r.delete(events_key(web_prefix), *r.keys(f"{web_prefix}:counts:*"))
        r.close()
