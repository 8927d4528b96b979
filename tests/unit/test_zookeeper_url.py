"""``zookeeper://`` URLs: what they name, and a clear error (without the password) for
anything else."""

from __future__ import annotations

import pytest

pytest.importorskip("kazoo", reason="kazoo is not installed (the zookeeper extra)")

from celery_dlock import InvalidLockConfig
from celery_dlock.backends.zookeeper import ZkSpec, backend_from_url, parse_url


def test_one_host_defaults():
    spec = parse_url("zookeeper://zk1:2181")
    assert spec == ZkSpec(("zk1:2181",), "", None, 10.0)
    assert spec.connect_string == "zk1:2181"


def test_an_ensemble_with_a_chroot_a_login_and_a_timeout():
    spec = parse_url("zookeeper://app:s%3Ac%40r%2Fet@zk1:2181,zk2,[::1]:2182/my%20app/"
                     "locks?connect_timeout=2.5")
    assert spec.hosts == ("zk1:2181", "zk2:2181", "[::1]:2182")
    assert spec.chroot == "/my app/locks"
    assert spec.digest == "app:s:c@r/et"
    assert spec.connect_timeout == 2.5
    assert spec.connect_string == "zk1:2181,zk2:2181,[::1]:2182/my app/locks"
    assert "s:c@r/et" not in repr(spec)


def test_backend_from_url_takes_options():
    backend = backend_from_url("zookeeper://zk1:2181/x", connect_timeout=3)
    assert backend.spec.connect_timeout == 3
    assert backend.kind == "zookeeper" and backend.fences
    assert backend.storage_key("dlock", "stock:42") == "/x/dlock/stock%3A42"
    assert backend.storage_key("dlock", "..") == "/x/dlock/%2E%2E"


@pytest.mark.parametrize("url", [
    "redis://localhost:6379",
    "zookeeper://",
    "zookeeper://zk1:99999",
    "zookeeper://zk1:21x1",
    "zookeeper://zk 1:2181",
    "zookeeper://zk1:2181/a/../b",
    "zookeeper://zk1:2181?timeout=3",
    "zookeeper://zk1:2181?connect_timeout=0",
    "zookeeper://zk1:2181?connect_timeout=soon",
    "zookeeper://user@zk1:2181",
])
def test_bad_urls_are_refused(url):
    with pytest.raises(InvalidLockConfig):
        parse_url(url)


@pytest.mark.parametrize("url", [
    "zookeeper://app:topsecret@zk1:99999",
    "zookeeper://app:topsecret@zk1:2181?bogus=1",
    "zookeeper://app:top#secret@zk1:2181",
])
def test_errors_never_show_the_password(url):
    with pytest.raises(InvalidLockConfig) as info:
        parse_url(url)
    assert "secret" not in str(info.value)


def test_a_ttl_zookeeper_cannot_keep_is_refused_up_front():
    from celery_dlock.backends.zookeeper import ZooKeeperLock

    with pytest.raises(InvalidLockConfig, match=r"24\.8 days"):
        ZooKeeperLock("zookeeper://zk1:2181", "x", ttl=25 * 86400)
    with pytest.raises(InvalidLockConfig):
        ZooKeeperLock("zookeeper://zk1:99999", "x")


def test_importing_the_package_imports_no_zookeeper_driver():
    import subprocess
    import sys

    code = ("import sys, celery_dlock, celery_dlock.task; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kazoo' or "
            "m.startswith('celery_dlock.backends.zookeeper')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
