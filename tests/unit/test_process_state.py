"""What a process keeps for itself has one home (celery_dlock/core/process.py): every
module registers its reset there, one ``os.register_at_fork`` runs them in a forked
child, in the order they were registered."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import celery_dlock.task  # noqa: F401 (imports every module that keeps state)
from celery_dlock.core import process

PACKAGE = Path(__file__).resolve().parents[2] / "celery_dlock"


def test_only_the_registry_registers_with_fork() -> None:
    callers = [p.relative_to(PACKAGE).as_posix() for p in sorted(PACKAGE.rglob("*.py"))
               if re.search(r"\bregister_at_fork\b", p.read_text(encoding="utf-8"))]
    assert callers == ["core/process.py"]


def test_a_forked_child_runs_every_reset_in_order() -> None:
    read, write = os.pipe()
    ran: list[str] = []
    first = process.after_fork(lambda: ran.append("first"))
    second = process.after_fork(lambda: os.write(write, ",".join([*ran, "second"])
                                                 .encode()))
    try:
        with warnings.catch_warnings():  # a multi-threaded parent (Python 3.12+)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: the resets ran before this line
            os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        with os.fdopen(read) as seen:
            assert seen.read() == "first,second"
        assert ran == []  # the parent's own state is left alone
    finally:
        process._resets.remove(first)
        process._resets.remove(second)


def test_the_modules_that_keep_state_are_registered() -> None:
    modules = {reset.__module__ for reset in process.resets()
               if hasattr(reset, "__module__")}
    for needed in ("celery_dlock.core.owner", "celery_dlock.core.scheduler",
                   "celery_dlock.task.app_cache",
                   "celery_dlock.backends.redis.renewal"):
        assert needed in modules, needed


def test_shutdown_runs_every_step_in_order_past_one_that_fails() -> None:
    ran: list[str] = []

    def failing() -> None:
        ran.append("failing")
        raise RuntimeError("a step that fails")

    steps = [process.at_shutdown(lambda: ran.append("first") or "one"),
             process.at_shutdown(failing),
             process.at_shutdown(lambda: ran.append("last") or "three")]
    before = len(process.shutdown_steps()) - len(steps)
    try:
        results = process.shutdown()
        assert ran[-3:] == ["first", "failing", "last"]
        assert results[before:] == ["one", None, "three"]
    finally:
        for step in steps:
            process._shutdown.remove(step)


def test_a_process_releases_its_holds_before_it_closes_its_sessions() -> None:
    import celery_dlock.backends.zookeeper.session  # noqa: F401  (registers its close)
    from celery_dlock.task import hooks

    names = [getattr(s, "__qualname__", "") for s in process.shutdown_steps()]
    assert hooks.release_process_holds in process.shutdown_steps()
    assert names.index("release_process_holds") < names.index("_close_all")
