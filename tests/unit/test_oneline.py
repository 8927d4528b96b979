"""One-line usage errors: every URL's password masked, whatever else is in the line."""

from __future__ import annotations

from celery_dlock.ops.oneline import mask_secrets


def test_every_url_in_a_line_has_its_password_masked() -> None:
    line = ("unrecognized arguments: redis://:pw1@h:6379/0 x "
            "(rediss://user:pw2@h2/1) 'sentinel://:pw3@s:26379'")
    masked = mask_secrets(line)
    for secret in ("pw1", "pw2", "pw3"):
        assert secret not in masked
    assert "redis://:**@h:6379/0" in masked
    assert masked.startswith("unrecognized arguments: ") and " x " in masked


def test_a_line_without_urls_is_unchanged() -> None:
    assert mask_secrets("No such option '--bogus'.") == "No such option '--bogus'."
