"""A lock's key suffixes are defined once, in Python, and the Lua uses those."""

from __future__ import annotations

import re

from celery_dlock.backends.redis import scripts
from celery_dlock.backends.redis.keyspace import SUFFIXES, LockKeys

_SCRIPTS = [v for v in vars(scripts).values() if isinstance(v, scripts.LuaScript)]


def test_the_scripts_spell_no_suffix_of_their_own():
    for script in _SCRIPTS:
        body = script.source
        for name, suffix in SUFFIXES.items():
            defined = f"local {name} = '{suffix}'"
            literal = re.compile(r"\.\.\s*'" + re.escape(suffix) + "'")
            assert not literal.search(body), f"{script.name} spells {suffix!r}"
            if name in body.replace(defined, ""):
                assert defined in body, f"{script.name} uses {name} undefined"


def test_python_and_lua_name_the_same_keys():
    keys = LockKeys.for_name("p", "n")
    assert keys.fence == keys.lock + SUFFIXES["FENCE_SUFFIX"]
    assert keys.queue == keys.lock + SUFFIXES["QUEUE_SUFFIX"]
    assert keys.leases == keys.lock + SUFFIXES["LEASES_SUFFIX"]
    assert keys.doorbell_prefix == keys.lock + SUFFIXES["DOORBELL_SUFFIX"]
    assert keys.released == keys.lock + SUFFIXES["RELEASED_SUFFIX"]
    used = {name for s in _SCRIPTS for name in SUFFIXES if name in s.source}
    assert used == set(SUFFIXES), set(SUFFIXES) - used
