"""ListJobs paging: page sizes, page tokens and the cut of one answer.

A daemon that has run thousands of jobs would otherwise answer ListJobs with all of them, above
the 4 MiB a default gRPC client receives (RESOURCE_EXHAUSTED for every caller). Jobs are listed
oldest first, by the number the store gave each at its creation (`listed_seq`: one above every
job before it). A page token is the key of the last job sent, so a job created while a client
pages sorts after every job it has seen and shows up on a later page, and no job that existed
when paging began is sent twice or skipped. Not by creation time: a wall clock that steps back
(NTP, a VM restored) would give a new job a time before the token's, and it would be skipped.

The jobs headed by another daemon of which this node runs a share come after the daemon's own,
by name (their numbers are their heads'); a share that starts while a client pages shows up
unless its name sorts before the last such job already sent. The token also records
`include_finished`, so that it cannot be replayed against a different listing.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ds3d.trainer.config import valid_job_name
from ds3d.trainer.errors import ConfigError

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 100   # jobs per answer when a request names no page_size (older clients)
MAX_PAGE_SIZE = 1000      # a larger page_size is served as this many
# one answer's jobs, in serialized bytes: below grpc's default 4 MiB a client receives, whatever
# the jobs hold (long messages, many stage boundaries)
PAGE_MAX_BYTES = 3 << 20
TOKEN_MAX_CHARS = 1024    # the tokens issued are ~100 characters; a longer one is refused unread
_TOKEN_PREFIX = "jobs2."
_OLD_TOKEN_PREFIX = "jobs1."  # (created_at, name) keys, before listed_seq
_TOKEN_CHARS = re.compile(r"[A-Za-z0-9_-]*={0,2}")
_FIELD_OVERHEAD = 8       # tag and length of one repeated message field, at most


@dataclass(frozen=True, order=True)
class JobKey:
    """A job's place in the listing: the daemon's own jobs by `listed_seq`, then the shared
    jobs (headed elsewhere) by name."""

    shared: bool
    seq: int  # the store's listed_seq of a job headed here; 0 for a shared job
    name: str


def own_key(listed_seq: int, name: str) -> JobKey:
    return JobKey(False, listed_seq, name)


def shared_key(name: str) -> JobKey:
    return JobKey(True, 0, name)


def page_size(requested: int) -> int:
    """The jobs one answer may hold: 0 is the default, above the maximum the maximum (as gRPC
    APIs usually coerce), a negative number is the caller's error."""
    if requested < 0:
        raise ConfigError(f"page_size={requested}: use 0 (default {DEFAULT_PAGE_SIZE}) or more "
                          f"(at most {MAX_PAGE_SIZE} are sent per answer)")
    return min(requested, MAX_PAGE_SIZE) or DEFAULT_PAGE_SIZE


def encode_token(after: JobKey, include_finished: bool) -> str:
    """The next_page_token that continues a listing after `after`."""
    raw = json.dumps([include_finished, after.shared, after.seq, after.name],
                     separators=(",", ":"))
    return _TOKEN_PREFIX + base64.urlsafe_b64encode(raw.encode()).decode()


def decode_token(token: str, include_finished: bool) -> JobKey | None:
    """The key a page token continues after (None for "" = the first page). Anything that is
    not a token this listing issued, or one issued for the other `include_finished`, raises
    ConfigError (INVALID_ARGUMENT) saying what to send instead."""
    if not token:
        return None
    if token.startswith(_OLD_TOKEN_PREFIX) and len(token) <= TOKEN_MAX_CHARS:
        raise ConfigError("page_token was issued by an older ds3dd (one that listed jobs by "
                          "creation time): start again without a page_token")
    payload = _token_payload(token)
    if payload is None:
        shown = repr(token) if len(token) <= 40 else f"{token[:40]!r}... ({len(token)} characters)"
        raise ConfigError(f"page_token {shown} is not a ListJobs page token of this daemon: pass "
                          "the next_page_token of the previous answer unchanged, or none for "
                          "the first page")
    issued_for, key = payload
    if issued_for != include_finished:
        raise ConfigError(f"page_token was issued for include_finished={issued_for}: repeat the "
                          "request with the same include_finished, or start again without a "
                          "page_token")
    return key


def _token_payload(token: str) -> tuple[bool, JobKey] | None:
    if len(token) > TOKEN_MAX_CHARS or not token.startswith(_TOKEN_PREFIX):
        return None
    body = token[len(_TOKEN_PREFIX):]
    if not _TOKEN_CHARS.fullmatch(body):
        return None
    try:
        value = json.loads(base64.urlsafe_b64decode(body).decode())
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    if not (isinstance(value, list) and len(value) == 4):
        return None
    issued_for, shared, seq, name = value
    if not isinstance(issued_for, bool) or not isinstance(shared, bool) \
            or not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 2**63 \
            or (shared and seq != 0) or not isinstance(name, str) or not valid_job_name(name):
        return None
    return issued_for, JobKey(shared, seq, name)


def take_page(candidates: Sequence[T], key: Callable[[T], JobKey], size: int,
              byte_size: Callable[[T], int]) -> tuple[list[T], JobKey | None]:
    """One answer from `candidates` (every job after the token's key, or at least the first
    `size` + 1 of them): the first `size` in listing order that fit PAGE_MAX_BYTES (always at
    least one), and the key to continue after, None when nothing is left."""
    ordered = sorted(candidates, key=key)
    page: list[T] = []
    room = PAGE_MAX_BYTES
    for item in ordered[:size]:
        cost = byte_size(item) + _FIELD_OVERHEAD
        if page and cost > room:
            break
        page.append(item)
        room -= cost
    more = len(ordered) > len(page)
    return page, (key(page[-1]) if more and page else None)
