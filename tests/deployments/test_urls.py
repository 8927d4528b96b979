"""URL spellings that are refused, with the setting named and no password shown."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_dlock import InvalidLockConfig
from celery_dlock.task.config import get_client, resolve_url


def _app(**conf: object) -> Celery:
    app = Celery("urls", set_as_current=False)
    app.conf.update(**conf)
    return app


@pytest.mark.parametrize("url", [
    "redis+cluster://127.0.0.1:7000", "rediss+cluster://127.0.0.1:7000",
    "sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380", "unix:///tmp/r.sock",
])
def test_every_spelling_is_accepted(url):
    assert resolve_url(_app(dlock_url=url).conf) == url


def test_a_sentinel_broker_is_followed_but_a_failover_list_is_not():
    sentinels = "sentinel://127.0.0.1:26379;sentinel://127.0.0.1:26380"
    assert resolve_url(_app(broker_url=sentinels).conf) == sentinels
    with pytest.raises(InvalidLockConfig, match="dlock_url"):
        resolve_url(_app(broker_url="redis://a:6379;redis://b:6379").conf)


def test_an_unknown_scheme_names_the_setting():
    with pytest.raises(InvalidLockConfig, match=r"dlock_url must be .*redis\+cluster"):
        resolve_url(_app(dlock_url="memcached://127.0.0.1:11211").conf)


@pytest.mark.parametrize(("url", "options", "match"), [
    ("sentinel://:pw-1@127.0.0.1:26379;redis://127.0.0.1:6379",
     {"master_name": "m"}, "every ';'-separated part must be a sentinel:// URL"),
    ("sentinel://:pw-1@127.0.0.1:26379/x", {"master_name": "m"}, "database"),
    ("sentinel://:pw-1@127.0.0.1:26379", {}, "master_name"),
    ("sentinel://:pw-1@127.0.0.1:26379", {"master_name": "m", "sentinel_kwargs": 3},
     "sentinel_kwargs must be a dict"),
])
def test_bad_sentinel_settings_are_one_line_without_the_password(url, options, match):
    with pytest.raises(InvalidLockConfig, match=match) as caught:
        get_client(_app(dlock_url=url, dlock_transport_options=options))
    assert "pw-1" not in str(caught.value)
    assert len(str(caught.value).splitlines()) == 1


def test_transport_options_must_be_a_dict():
    app = _app(dlock_url="sentinel://127.0.0.1:26379", dlock_transport_options="m")
    with pytest.raises(InvalidLockConfig, match="dlock_transport_options must be a dict"):
        get_client(app)
