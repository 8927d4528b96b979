"""``celery dlock check``: whether the app's lock store can keep locks, before a task
finds out (:mod:`celery_dlock.core.store_check` says what is checked).

Exit status: 0 usable, 1 problems found (one line each, on stderr), 2 the store does
not answer (one line, as every ``celery dlock`` command says it).
"""

from __future__ import annotations

import click

from .formatting import printable
from .target import EXIT_NOT_FOUND, reports_redis_errors, target_of

__all__ = ["check"]

#: The exit status of a store that answers and has problems.
EXIT_PROBLEMS = EXIT_NOT_FOUND


@click.command()
@click.pass_context
@reports_redis_errors
def check(ctx: click.Context) -> None:
    """Check that the lock store can keep locks: it answers, its version and (on
    Redis) eviction policy, and a lock taken and released under the prefix (a table
    it can use, its grants, an ACL that lets every command through).  One line per
    problem; exit status 1 when there is one."""
    target = target_of(ctx)
    problems = target.backend().check(target.prefix)
    where = f"{target.store()} at {target.where()}"
    if not problems:
        click.echo(printable(f"ok: the {where} keeps locks under prefix "
                             f"{target.prefix!r}"))
        return
    for problem in problems:
        click.echo(printable(f"{where}: {problem}"), err=True)
    ctx.exit(EXIT_PROBLEMS)
