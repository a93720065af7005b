"""Listen policy and token files: the daemon refuses to be exposed without mTLS and a token."""

import pytest

from ds3d.daemon.auth import check_listen_policy, is_local_address, read_token, tls_files
from ds3d.trainer.errors import ConfigError

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("addr,local", [
    ("127.0.0.1:7531", True), ("127.0.0.9:1", True), ("[::1]:7531", True),
    ("localhost:1", True), ("unix:/tmp/x.sock", True), ("0.0.0.0:7531", False),
    ("[::]:7531", False), ("10.0.0.5:7531", False), ("node1:7531", False),
])
def test_is_local_address(addr, local):
    assert is_local_address(addr) is local


def test_beyond_loopback_requires_tls_and_token(tmp_path):
    with pytest.raises(ConfigError, match="mutual TLS.*--token-file"):
        check_listen_policy("0.0.0.0:7531", None, None)
    check_listen_policy("127.0.0.1:0", None, None)


def test_tls_needs_all_three_files(tmp_path):
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ConfigError, match="missing --tls-key, --tls-ca"):
        tls_files(str(cert), None, None)
    assert tls_files(None, None, None) is None


def test_token_file(tmp_path):
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ConfigError, match="at least 16"):
        read_token(short)
    good = tmp_path / "good"
    good.write_text("0123456789abcdefXYZ\n")
    assert read_token(good) == "0123456789abcdefXYZ"
    with pytest.raises(ConfigError, match="does not exist"):
        read_token(tmp_path / "none")
