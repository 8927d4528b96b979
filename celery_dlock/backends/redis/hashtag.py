"""The Redis key of a lock's hash, and the lock name back from a key.

On Redis Cluster, every key of one lock must hash to one slot, because each script
touches several of them.  Cluster hashes only the *hash tag* of a key when it has one:
the text between the first ``{`` and the first ``}`` after it, if that text is not
empty (otherwise the whole key).  The rule, for prefix ``P`` (without braces) and a
non-empty lock name ``NAME``:

* ``P:{NAME}`` when ``NAME`` does not start with ``}``.  The tag is ``NAME`` up to its
  first ``}`` (all of it when it has none): never empty.
* ``P:#{D}{NAME}`` when ``NAME`` starts with ``}`` (``}``, ``}{``, ``}}``, ``}lock``).
  In ``P:{NAME}`` those would have the empty tag ``{}``, so Cluster would hash each
  key of the lock whole and scatter them over slots.  ``D`` is the first 16 hex digits
  of the SHA-1 of ``NAME`` (UTF-8): a non-empty tag that spreads such names over slots.

The helper keys of a lock (fence counter, waiters' line, doorbells) are the lock key
plus a suffix without braces, so they share its tag.  Both forms end with ``}`` and no
suffix contains one, so no key of one lock can be a key of another, and the two forms
never meet (``P:{`` against ``P:#{``).

Names that do not start with ``}`` keep the key they always had.  Names that do had the
key ``P:{NAME}`` before this rule (celery-dlock 0.1), which worked on a single server
only: stop every process of the old version before starting the new one when such
names are in use, or a hold under the old key and one under the new key can coexist.
"""

from __future__ import annotations

import hashlib

__all__ = ["lock_key", "name_of_key", "scan_pattern"]

_DIGEST_LEN = 16


def _digest(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:_DIGEST_LEN]


def lock_key(prefix: str, name: str) -> str:
    """The key of the hash of lock ``name`` under ``prefix``."""
    if name.startswith("}"):
        return f"{prefix}:#{{{_digest(name)}}}{{{name}}}"
    return f"{prefix}:{{{name}}}"


def name_of_key(prefix: str, key: str) -> str | None:
    """The lock name of a lock hash's key under ``prefix`` (None for other keys)."""
    if not key.endswith("}"):
        return None
    plain = f"{prefix}:{{"
    if key.startswith(plain) and len(key) > len(plain) + 1:
        # (``P:{}x}`` is how 0.1 keyed the name ``}x``: shown, so it can be found.)
        return key[len(plain):-1]
    tagged = f"{prefix}:#{{"
    if key.startswith(tagged):
        rest = key[len(tagged):]
        digest, sep, body = rest[:_DIGEST_LEN], rest[_DIGEST_LEN:_DIGEST_LEN + 2], \
            rest[_DIGEST_LEN + 2:-1]
        if sep == "}{" and body.startswith("}") and _digest(body) == digest:
            return body
    return None


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def scan_pattern(prefix: str) -> str:
    """The ``SCAN MATCH`` pattern of every lock hash under ``prefix`` (both forms)."""
    return f"{_glob_escape(prefix)}:[{{#]*}}"
