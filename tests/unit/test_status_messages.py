"""Refusals as the client receives them: grpc sends a status message percent-encoded in a
header, and a client drops a call whose headers pass 16 KiB, so ds3dd cuts every refusal to
fit (daemon/errors.py `fitted`)."""

from __future__ import annotations

import pytest

from ds3d.daemon.errors import STATUS_MESSAGE_MAX_BYTES, fitted, quoted

pytestmark = pytest.mark.timeout(30)


def _sent_bytes(message: str) -> int:
    """Bytes of the grpc-message header: printable ASCII but '%' as is, the rest %XX."""
    return sum(1 if 0x20 <= b <= 0x7E and b != 0x25 else 3 for b in message.encode())


@pytest.mark.parametrize("message", ["x" * 1_000_000, "\u00e9" * 100_000, "%\n" * 50_000,
                                     "\U0001f600" * 10_000])
def test_a_huge_refusal_is_cut_to_what_a_client_receives(message):
    out = fitted(message)
    assert _sent_bytes(out) <= STATUS_MESSAGE_MAX_BYTES
    assert out.startswith(message[:100]) and out.endswith("characters in all]")


def test_a_refusal_that_fits_is_unchanged():
    message = "job name 'x/y' is not allowed: use 1-63 characters\n  - and a second line"
    assert fitted(message) == message


def test_quoted_shortens_long_values():
    assert quoted("abc") == "'abc'"
    assert quoted("y" * 500) == f"{'y' * 80!r}... (500 characters)"
