"""Passwords with URL delimiters (``; # ? / @ : %``): where a ``;``-separated list is
cut, what every message shows of a URL, and which URLs are refused (no server needed:
nothing here connects)."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from url_passwords import PASSWORDS, RAW_WORKS, assert_hidden, encoded

from celery_dlock import InvalidLockConfig
from celery_dlock.core.text import clean_text
from celery_dlock.core.urls import ambiguity, split_urls
from celery_dlock.ops.oneline import mask_secrets
from celery_dlock.task.config import check_conf, mask_url, resolve_url


def _urls(password: str) -> dict[str, Any]:
    """Every spelling that carries a password, with ``password`` as it is."""
    one = f"redis://:{password}@127.0.0.1:6379/0"
    return {
        "one": one,
        "user": f"redis://dlock:{password}@127.0.0.1:6379/0",
        "tls": f"rediss://dlock:{password}@127.0.0.1:6380/0?ssl_cert_reqs=none",
        "query": f"redis://127.0.0.1:6379/0?password={password}",
        "cluster": f"redis+cluster://:{password}@127.0.0.1:7000",
        "sentinel": f"sentinel://:{password}@127.0.0.1:26379;sentinel://127.0.0.1:26380",
        "redlock": ";".join(f"redlock://:{password}@127.0.0.1:{p}/0"
                            for p in (6379, 6380, 6381)),
        "list": [f"redis://:{password}@127.0.0.1:{p}/0" for p in (6379, 6380, 6381)],
    }


@pytest.mark.parametrize("password", PASSWORDS)
@pytest.mark.parametrize("form", ["raw", "encoded"])
def test_no_message_shows_any_part_of_the_password(password: str, form: str) -> None:
    written = password if form == "raw" else encoded(password)
    for what, url in _urls(written).items():
        shown = mask_url(url)
        assert_hidden(shown, password)
        assert shown.startswith(("red", "sentinel", "[")), what
        if isinstance(url, str):
            line = f"failed at {url} (see {url!r}), then 'x'"
            assert_hidden(mask_secrets(line), password)
            assert_hidden(clean_text(line), password)
            assert mask_secrets(line).endswith("then 'x'"), what


def test_an_encoded_password_is_masked_and_the_rest_kept() -> None:
    pw = encoded("p;a#s?s/w@o:r%d")
    assert mask_url(f"redis://dlock:{pw}@h:6379/0") == "redis://dlock:**@h:6379/0"
    assert mask_url(f"sentinel://:{pw}@a:26379;sentinel://b:26379") == \
        "sentinel://:**@a:26379;sentinel://b:26379"
    assert mask_url(f"redis://h/0?password={pw}&db=1") == "redis://h/0?password=**&db=1"
    # a user name that is not plain text may be part of a password: masked too
    assert mask_url("redis://w@o:x@h/0") == "redis://**@h/0"


def test_a_url_that_reads_two_ways_shows_its_scheme_only() -> None:
    assert mask_url("redis://:p;a#s?s/w@o:r%d@h:6379/0") == "redis://**"


@pytest.mark.parametrize(("text", "parts"), [
    ("sentinel://a:26379;sentinel://b:26379", ["sentinel://a:26379", "sentinel://b:26379"]),
    ("sentinel://a:26379 ; sentinel://b:26379;", ["sentinel://a:26379",
                                                   "sentinel://b:26379"]),
    (f"redlock://:{RAW_WORKS}@a/0;redlock://b/0", [f"redlock://:{RAW_WORKS}@a/0",
                                                    "redlock://b/0"]),
    ("redis://:p;redis@a/0", ["redis://:p;redis@a/0"]),
    ("redis://a:6379;b:6379", ["redis://a:6379;b:6379"]),
])
def test_a_semicolon_cuts_only_where_another_url_starts(text: str,
                                                        parts: list[str]) -> None:
    assert split_urls(text) == parts


@pytest.mark.parametrize("url", [
    "redis://:p;a#s?s/w@o:r%d@h:6379/0", "redis://:ab/cd@h/0", "redis://:ab?cd@h/0",
    "redis://h:6379/0#x", "redis://h/0?client_name=a@b", "unix:///tmp/a@b.sock",
])
def test_what_reads_two_ways(url: str) -> None:
    assert ambiguity(url) is not None


@pytest.mark.parametrize("url", [
    f"redis://:{encoded('p;a#s?s/w@o:r%d')}@h:6379/0", f"redis://:{RAW_WORKS}@h/0",
    "unix:///tmp/r.sock?db=1", "redis://h:6379/0?client_name=a%40b",
])
def test_what_reads_one_way(url: str) -> None:
    assert ambiguity(url) is None


SENTINEL_OPTIONS = {"master_name": "m"}


def _app(**conf: Any) -> Celery:
    app = Celery("urlpw", set_as_current=False)
    app.conf.update(**conf)
    return app


@pytest.mark.parametrize("password", PASSWORDS)
def test_an_unencoded_delimiter_that_makes_a_url_ambiguous_is_refused(
        password: str) -> None:
    for what, url in _urls(password).items():
        if what == "query":
            continue  # a query value: see test_what_reads_two_ways
        for setting in ("dlock_url", "broker_url"):
            if setting == "broker_url" and what in ("redlock", "list"):
                continue
            app = _app(**{setting: url}, dlock_transport_options=SENTINEL_OPTIONS,
                       broker_transport_options=SENTINEL_OPTIONS)
            if password == RAW_WORKS:
                check_conf(app.conf)  # no '#', '?' or '/': it reads one way
                continue
            with pytest.raises(InvalidLockConfig) as caught:
                check_conf(app.conf)
            text = str(caught.value)
            assert_hidden(text, password)
            assert "%23" in text and "%2F" in text and "quote(" in text, text
            assert "one way only" in text and "\n" not in text
            expected = "app.conf.dlock_url" if setting == "dlock_url" else "broker"
            assert expected in text, (what, text)


@pytest.mark.parametrize("password", PASSWORDS)
def test_encoded_urls_pass_the_checks_and_reach_redis_py_decoded(password: str) -> None:
    for what, url in _urls(encoded(password)).items():
        app = _app(dlock_url=url, dlock_transport_options=SENTINEL_OPTIONS)
        check_conf(app.conf)
        if what in ("one", "user", "sentinel"):
            assert resolve_url(app.conf) == url
    import redis

    kwargs = redis.connection.parse_url(f"redis://u:{encoded(password)}@h:1/0")
    assert kwargs["password"] == password and kwargs["username"] == "u"
