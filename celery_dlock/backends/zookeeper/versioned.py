"""The persistent nodes kept by compare-and-set on the ensemble's clock (rates,
:mod:`.rates`; queue markers, :mod:`.markers`): one node per name under a subtree,
read, listed, and written only at the version read (or made only where there is
none), on the nodes' session (:mod:`.clock`)."""

from __future__ import annotations

from typing import Any

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from .clock import call
from .nodes import decode_dir, is_name_segment
from .url import ZkSpec

__all__ = ["get", "names", "write"]


def get(spec: ZkSpec, path: str, what: str, name: str | None
        ) -> tuple[bytes, Any] | None:
    """The node's data and stat (no clock written); None: no node."""
    try:
        raw, stat = call(spec, what, name, path, lambda c: c.get_async(path))
    except NoNodeError:
        return None
    return raw, stat


def names(spec: ZkSpec, subtree: str, what: str) -> list[str]:
    """The names of the nodes under ``subtree``, sorted (not its clock); none where
    there is no subtree."""
    try:
        segments = call(spec, what, None, subtree,
                        lambda c: c.get_children_async(subtree))
    except NoNodeError:
        return []
    return sorted(decode_dir(s) for s in segments if is_name_segment(s))


def write(spec: ZkSpec, path: str, data: bytes, version: int | None, what: str,
          name: str) -> bool:
    """Write the node if it is still at ``version`` (None: make it, if there is
    still none); False when another call got there first (or it is gone)."""
    try:
        if version is None:
            call(spec, what, name, path,
                 lambda c: c.create_async(path, data, makepath=True))
        else:
            call(spec, what, name, path, lambda c: c.set_async(path, data, version))
    except (BadVersionError, NodeExistsError, NoNodeError):
        return False
    return True
