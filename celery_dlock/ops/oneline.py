"""Usage errors of the commands as one line, with any password masked.

``argparse`` and ``click`` print a usage block before the error; the commands print
one line instead, ending with where to find the help.  A URL anywhere in the line (a
stray argument, a value given to the wrong option) has its password replaced by ``**``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

import click

from ..core.urls import mask_secrets

__all__ = ["OneLineGroup", "OneLineParser", "OneLineUsageError", "mask_secrets"]


class OneLineParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose errors are one masked line, exit 2."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {mask_secrets(message)} "
                         f"(see {self.prog} --help)\n")
        sys.exit(2)


class OneLineUsageError(click.UsageError):
    """A click usage error shown as ``celery dlock ls: No such option ... (see ...)``."""

    def show(self, file: Any = None) -> None:
        path = self.ctx.command_path if self.ctx is not None else "celery dlock"
        click.echo(f"{path}: {mask_secrets(self.format_message())} "
                   f"(see '{path} --help')", file=file, err=file is None)


# click >= 8.2 raises this for a group called without a sub-command: it shows the help.
_SHOWS_HELP: tuple[type[click.UsageError], ...] = tuple(
    t for t in (getattr(click.exceptions, "NoArgsIsHelpError", None),)
    if isinstance(t, type))


def _one_line(exc: click.UsageError) -> click.UsageError:
    if isinstance(exc, (OneLineUsageError, *_SHOWS_HELP)):
        return exc
    return OneLineUsageError(exc.format_message(), exc.ctx)


class OneLineGroup(click.Group):
    """A click group whose usage errors, and its sub-commands', are one line."""

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.UsageError as exc:
            raise _one_line(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            raise _one_line(exc) from None
