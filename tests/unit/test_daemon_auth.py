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


@pytest.mark.timeout(30)
@pytest.mark.parametrize("content, phrase", [
    (b"\xff\xfe0123456789abcdefgh\n", "cannot be read"),
    ("tokén-with-ünïcode-0123456789\n".encode(), "non-ASCII characters inside"),
    (b"0123456789 abcdefghij\n", "has spaces"),
    (b"x" * 5000, "5000 bytes; a token file holds the token only"),
    ("FIFO", "not a regular file"),
])
def test_a_token_file_no_client_could_use_is_refused(tmp_path, content, phrase):
    """Was: a file that is not UTF-8 a UnicodeDecodeError traceback from ds3dd's start, and a
    token with non-ASCII characters accepted, though no gRPC client can send it (metadata is
    ASCII): a daemon nobody could call."""
    import os

    path = tmp_path / "token"
    if content == "FIFO":
        os.mkfifo(path)
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=phrase):
        read_token(path)
