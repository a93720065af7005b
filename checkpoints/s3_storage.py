"""`S3Storage`: the `Storage` contract on any S3-compatible server through boto3.

Where the settings come from: the standard AWS chain (env `AWS_ACCESS_KEY_ID`/`..._SECRET_...`,
profiles, instance roles, `AWS_REGION`, and `AWS_ENDPOINT_URL`, which boto3 reads itself), plus
`DS3D_S3_ENDPOINT` (ds3d's own override, checked first) or an explicit `endpoint_url`. A custom
endpoint uses path-style addressing (MinIO, Ceph RGW, moto have no virtual-host DNS).

How failures are handled, in two layers:
- botocore retries single requests ("standard" mode, `max_attempts`) for throttling and 5xx;
- `_call` retries a whole operation (a whole multipart upload, a download) with exponential
  backoff and jitter when it still fails with an outage, because an endpoint that is down for
  a minute should delay a checkpoint, not lose it.
`classify_error` is the ONE place that maps botocore/boto3 exceptions onto ds3d's errors, so
credential and configuration problems (terminal, with what to fix) are never confused with
outages (`TransientStorageError`, retried).

Files below `multipart_threshold` go up in one PUT through boto3's transfer manager. Larger ones
are multipart uploads that RESUME: parts of `multipart_chunksize` sent by at most
`max_concurrency` threads (so at most that many parts are in memory, whatever the file size),
each with its Content-MD5. The UploadId is remembered in an `UploadJournal` (in memory, and in a
file of the checkpoint's local upload state when the caller opens one with `upload_journal`), so
when an outage or a dead process interrupts an upload, the retry asks the server which parts it
has (`ListParts`), keeps those whose size and ETag (the MD5 of a non-encrypted part, on AWS,
moto and RGW alike) match the local bytes, sends only the others, then completes. If the server
no longer knows the upload (aborted, expired by a lifecycle rule, or a server that lost its
state) it starts over, after checking whether an earlier completion did in fact go through. An
upload is aborted when its local file changed, and once a key's upload completes, any other
unfinished upload of that key (left by a process killed before it could journal) is aborted, so
storage does not leak. `max_bandwidth` (bytes/s) keeps uploads from starving the training's own
network traffic (parts are paced to that average rate).

Settings come from the constructor; `from_url` (what `open_storage` uses, so workers too) also
reads `DS3D_S3_MULTIPART_THRESHOLD_MIB`, `DS3D_S3_MULTIPART_CHUNKSIZE_MIB`,
`DS3D_S3_MAX_CONCURRENCY`, `DS3D_S3_MAX_BANDWIDTH_MIB` (MiB/s, 0 = unlimited),
`DS3D_S3_OUTAGE_RETRIES` and `DS3D_S3_MAX_ATTEMPTS`; options passed explicitly win over them.

Conditional create (`put_bytes(if_absent=True)`) sends `If-None-Match: *`, and then ALWAYS reads
the object back: some S3 servers (JuiceFS, rclone gateways; RGW on multipart completion)
silently ignore the condition, so the server's 200 alone proves nothing.
"""

from __future__ import annotations

import base64
import builtins
import hashlib
import json
import math
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlparse

import boto3
import structlog
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from s3transfer.exceptions import RetriesExceededError

from .errors import (
    ConfigError,
    Ds3dError,
    NotFoundError,
    PermissionError_,
    StorageError,
    TransientStorageError,
)
from .storage import ObjectInfo

log = structlog.get_logger("ds3d.checkpoints.s3")

ENDPOINT_ENV = "DS3D_S3_ENDPOINT"
MiB = 1 << 20
T = TypeVar("T")

_CREDENTIAL_HINTS = {
    "InvalidAccessKeyId": "the access key id is unknown to the server; check AWS_ACCESS_KEY_ID "
                          "(or the profile in AWS_PROFILE) and that the endpoint is the right one",
    "SignatureDoesNotMatch": "the secret key does not match the access key; check "
                             "AWS_SECRET_ACCESS_KEY (or the profile's secret)",
    "AccessDenied": "the credentials are valid but not allowed to do this; grant s3:ListBucket on "
                    "the bucket and s3:GetObject, s3:PutObject, s3:DeleteObject on the prefix "
                    "(and, to resume and clean up interrupted uploads, "
                    "s3:ListBucketMultipartUploads, s3:ListMultipartUploadParts, "
                    "s3:AbortMultipartUpload)",
    "AllAccessDisabled": "all access to this bucket has been disabled by its owner",
    "ExpiredToken": "the session token has expired; refresh the credentials",
    "InvalidToken": "the session token is malformed or invalid; refresh the credentials",
    "TokenRefreshRequired": "the session token must be refreshed",
    "RequestTimeTooSkewed": "this machine's clock differs too much from the server's; fix the "
                            "clock (NTP)",
    "AuthorizationHeaderMalformed": "the request was signed for another region; set AWS_REGION "
                                    "to the bucket's region",
    "AccountProblem": "the account behind these credentials has a problem; contact its owner",
}
_TRANSIENT_CODES = {
    "SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError", "Throttling",
    "ThrottlingException", "RequestThrottled", "TooManyRequests", "OperationAborted",
    "ConditionalRequestConflict", "RequestTimeoutException", "BandwidthLimitExceeded",
    "BadDigest",  # a part's bytes changed in transit (its Content-MD5 did not match): send again
}


def classify_error(exc: BaseException, *, op: str, bucket: str, key: str | None = None,
                   endpoint: str | None = None) -> Ds3dError:
    """Maps one boto3/botocore exception to the error hierarchy, with what to fix.

    `op` names the operation ("PutObject", ...), `key` the object (None for bucket-level calls,
    so that a bare 404 then means a missing bucket)."""
    if isinstance(exc, Ds3dError):
        return exc
    cause = _unwrap(exc)
    where = f"s3://{bucket}/{key}" if key is not None else f"s3://{bucket}"
    via = f" at {endpoint}" if endpoint else ""
    if isinstance(cause, ClientError):
        err = cause.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = int(cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        if code.isdigit() and not status:
            status = int(code)
        msg = err.get("Message") or code
        if code == "NoSuchBucket" or (status == 404 and key is None):
            return NotFoundError(f"{op} {where}: bucket {bucket!r} does not exist{via}; create "
                                 "it or fix the store URL / endpoint")
        if code in ("NoSuchKey", "NotFound") or status == 404:
            return NotFoundError(f"{op} {where}: no such object")
        if code in _CREDENTIAL_HINTS:
            return PermissionError_(f"{op} {where} refused ({code}): {_CREDENTIAL_HINTS[code]}")
        if status in (401, 403):
            return PermissionError_(f"{op} {where} refused ({code or status}): the credentials "
                                    "are wrong or not allowed; check AWS_ACCESS_KEY_ID, "
                                    "AWS_SECRET_ACCESS_KEY and the bucket policy")
        if code in _TRANSIENT_CODES or status >= 500 or status in (408, 429):
            return TransientStorageError(f"{op} {where}: server busy or failing ({code or status}"
                                         f": {msg}){via}; will retry")
        if status in (301, 307) or code in ("PermanentRedirect", "TemporaryRedirect"):
            return StorageError(f"{op} {where}: the bucket lives in another region or endpoint; "
                                "set AWS_REGION / the endpoint to where the bucket is")
        return StorageError(f"{op} {where} failed ({code or status}: {msg})")
    if isinstance(cause, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError)):
        return PermissionError_(f"{op} {where}: no usable S3 credentials ({cause}); set "
                                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE")
    if isinstance(cause, (HTTPClientError, BotoConnectionError, IncompleteReadError)):
        return TransientStorageError(f"{op} {where}: cannot reach the S3 endpoint{via} ({cause}); "
                                     f"is it up? (if the address is wrong, fix {ENDPOINT_ENV} "
                                     "or AWS_ENDPOINT_URL)")
    if isinstance(cause, BotoCoreError):
        return StorageError(f"{op} {where}: {cause}")
    if isinstance(cause, (ConnectionError, TimeoutError)):
        return TransientStorageError(f"{op} {where}: connection failed{via} ({cause})")
    return StorageError(f"{op} {where}: unexpected {type(cause).__name__}: {cause}")


def _unwrap(exc: BaseException) -> BaseException:
    """The botocore error inside boto3's transfer wrappers (which keep it as cause)."""
    seen = 0
    while seen < 5:
        seen += 1
        if isinstance(exc, RetriesExceededError) and exc.last_exception is not None:
            exc = exc.last_exception
        elif isinstance(exc, S3UploadFailedError) and exc.__cause__ is not None:
            exc = exc.__cause__
        else:
            break
    return exc


_BOTO_ERRORS = (ClientError, BotoCoreError, S3UploadFailedError, RetriesExceededError)

# S3's limits on multipart uploads (AWS, RGW and moto enforce the smallest part size).
MIN_PART = 5 * MiB  # every part but the last
MAX_PART = 5 * 1024 * MiB
MAX_PARTS = 10_000

# Environment variable -> (S3Storage option, unit in bytes or 1, smallest value allowed).
ENV_OPTIONS: dict[str, tuple[str, int, float]] = {
    "DS3D_S3_MULTIPART_THRESHOLD_MIB": ("multipart_threshold", MiB, 1 / MiB),
    "DS3D_S3_MULTIPART_CHUNKSIZE_MIB": ("multipart_chunksize", MiB, MIN_PART / MiB),
    "DS3D_S3_MAX_CONCURRENCY": ("max_concurrency", 1, 1),
    "DS3D_S3_MAX_BANDWIDTH_MIB": ("max_bandwidth", MiB, 0),
    "DS3D_S3_OUTAGE_RETRIES": ("outage_retries", 1, 0),
    "DS3D_S3_MAX_ATTEMPTS": ("max_attempts", 1, 1),
}


def options_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """S3Storage options set through `ENV_OPTIONS` (ds3dd's node-wide transfer settings, under a
    job's `[checkpoint.s3]`); a bad value is a ConfigError naming the variable."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for var, (option, unit, least) in ENV_OPTIONS.items():
        raw = env.get(var, "").strip()
        if not raw:
            continue
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"{var}={raw!r}: expected a number") from None
        if not math.isfinite(value) or value < least:
            raise ConfigError(f"{var}={raw!r}: must be at least {least:g}")
        out[option] = _option_value(option, unit, value)
    return out


def options_from_settings(settings: Mapping[str, float | None]) -> dict[str, Any]:
    """S3Storage options from a job's `[checkpoint.s3]` (its fields are the variable names of
    `ENV_OPTIONS` without the DS3D_S3_ prefix, lower case; bounds checked by the config)."""
    out: dict[str, Any] = {}
    for var, (option, unit, _least) in ENV_OPTIONS.items():
        value = settings.get(var.removeprefix("DS3D_S3_").lower())
        if value is not None:
            out[option] = _option_value(option, unit, float(value))
    return out


def _option_value(option: str, unit: int, value: float) -> int | None:
    return None if option == "max_bandwidth" and value == 0 else int(value * unit)  # 0: no cap


class UploadJournal:
    """The multipart uploads an uploader began and has not finished: object -> UploadId, part
    size and the local file's identity (size, mtime), so that a retry continues the same upload
    instead of sending every part again.

    Held in memory, and also in the JSON file `path` when given (the checkpoint's upload state in
    the local tier), so that the next process continues too. Each change rewrites the file
    atomically; losing it costs only re-sending, never a leak: the next completed upload of a key
    aborts the unfinished uploads of that key it finds. One thread writes a given file."""

    VERSION = 1

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._records: dict[str, dict[str, Any]] = {}
        data = None
        try:
            data = json.loads(self.path.read_text()) if self.path is not None else None
        except FileNotFoundError:
            pass  # nothing unfinished
        except (OSError, ValueError) as e:  # only costs re-sending what it listed
            log.warning("upload_journal_unreadable", path=str(self.path), detail=str(e))
        if isinstance(data, dict) and data.get("version") == self.VERSION:
            self._records = {k: v for k, v in (data.get("uploads") or {}).items()
                             if isinstance(v, dict) and "upload_id" in v}

    def get(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            rec = self._records.get(name)
            return dict(rec) if rec is not None else None

    def records(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {k: dict(v) for k, v in self._records.items()}

    def put(self, name: str, record: dict[str, Any]) -> None:
        with self._lock:
            self._records[name] = dict(record)
            self._save()

    def drop(self, name: str) -> None:
        with self._lock:
            if self._records.pop(name, None) is not None:
                self._save()

    def _save(self) -> None:
        if self.path is None:
            return
        if not self._records:
            self.path.unlink(missing_ok=True)
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"version": self.VERSION, "uploads": self._records}))
        os.replace(tmp, self.path)


class _Pacer:
    """Keeps the average upload rate at most `rate` bytes/s: a part starts once the parts before
    it would have been sent at that rate (each part itself goes at line speed)."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._free_at = 0.0

    def take(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            self._free_at = start + nbytes / self.rate
        if start > now:
            time.sleep(start - now)


class _UploadGone(Exception):
    """The server does not know this UploadId any more (completed, aborted or expired), or will
    not say which parts it holds (`denied`: no s3:ListMultipartUploadParts)."""

    def __init__(self, upload_id: str, denied: bool = False) -> None:
        super().__init__(upload_id)
        self.denied = denied


def _upload_gone(exc: ClientError) -> bool:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    # AWS and moto say NoSuchUpload; RGW answers ListParts of an unknown upload with NoSuchKey.
    return code == "NoSuchUpload" or (status == 404 and code != "NoSuchBucket")


def _md5(data: bytes | memoryview) -> Any:
    return hashlib.md5(data, usedforsecurity=False)


class S3Storage:
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 16 * MiB,
        max_concurrency: int = 4,
        max_bandwidth: int | None = None,
        max_attempts: int = 5,
        retry_mode: str = "standard",
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        outage_retries: int = 5,
        backoff_base: float = 0.5,
        backoff_max: float = 20.0,
    ) -> None:
        if not 3 <= len(bucket) <= 63:
            raise ConfigError(f"S3 bucket name {bucket!r} must have 3 to 63 characters")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.endpoint_url = endpoint_url or os.environ.get(ENDPOINT_ENV) or None
        self.outage_retries = outage_retries
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        config = Config(
            retries=cast(Any, {"mode": retry_mode, "max_attempts": max_attempts}),
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max(10, 2 * max_concurrency),
            # Older S3-compatible servers (RGW 16, MinIO before 2025) reject the CRC checksums
            # newer botocore adds by default; send them only where the API requires one.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            s3={"addressing_style": "path"} if self.endpoint_url else None,
        )
        session = boto3.session.Session()
        self.client = session.client(
            "s3", endpoint_url=self.endpoint_url, region_name=region, config=config,
            aws_access_key_id=access_key, aws_secret_access_key=secret_key)
        self.endpoint = self.endpoint_url or self.client.meta.endpoint_url
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
            use_threads=max_concurrency > 1,
            max_bandwidth=max_bandwidth,
            preferred_transfer_client="classic",
        )
        # s3transfer buffers up to this many parts per upload: the memory bound.
        self.transfer.max_in_memory_upload_chunks = max(2, 2 * max_concurrency)
        self.max_concurrency = max(1, max_concurrency)
        self._pacer = _Pacer(max_bandwidth) if max_bandwidth else None
        self._journal = UploadJournal()  # used where no thread opened a journal file
        self._local = threading.local()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> S3Storage:
        """`s3://bucket/prefix`; options not given are taken from `ENV_OPTIONS`, then defaults."""
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ConfigError(f"store {url!r}: expected s3://bucket/prefix")
        return cls(parsed.netloc, parsed.path, **{**options_from_env(), **options})

    def __repr__(self) -> str:
        return f"S3Storage({self.url!r}, endpoint={self.endpoint!r})"

    def _key(self, key: str) -> str:
        if not key or key.startswith("/") or "//" in key:
            raise StorageError(f"invalid object key {key!r}")
        return self.prefix + key

    def _call(self, op: str, key: str | None, fn: Callable[[], T]) -> T:
        """Runs a whole operation, retrying outages with exponential backoff and jitter."""
        for attempt in range(self.outage_retries + 1):
            try:
                return fn()
            except _BOTO_ERRORS as e:
                err = classify_error(e, op=op, bucket=self.bucket,
                                     key=None if key is None else self.prefix + key,
                                     endpoint=self.endpoint)
                if not err.retryable or attempt == self.outage_retries:
                    raise err from e
                delay = min(self.backoff_max, self.backoff_base * 2**attempt)
                delay *= 0.5 + random.random()
                log.warning("storage_retry", op=op, key=key, attempt=attempt + 1,
                            delay_s=round(delay, 2), cause=str(err))
                time.sleep(delay)
        raise AssertionError("unreachable")

    # -- writes -----------------------------------------------------------------------------

    def put_file(self, local_path: str | Path, key: str) -> None:
        """One PUT below `multipart_threshold`, else a multipart upload that resumes (see the
        module's docstring): a retry after an outage sends only the parts the server lacks."""
        full = self._key(key)
        path = Path(local_path)
        if path.stat().st_size < self.transfer.multipart_threshold:
            self._call("PutObject", key, lambda: self.client.upload_file(
                str(path), self.bucket, full, Config=self.transfer))
            return
        self._call("MultipartUpload", key, lambda: self._put_multipart(path, full))

    def put_bytes(self, key: str, data: bytes, if_absent: bool = False) -> bool:
        full = self._key(key)
        if not if_absent:
            self._call("PutObject", key, lambda: self.client.put_object(
                Bucket=self.bucket, Key=full, Body=data))
            return True
        if self.exists(key):
            return False

        def conditional_put() -> bool:
            try:
                self.client.put_object(Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*")
            except ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 412 or e.response.get("Error", {}).get("Code") == "PreconditionFailed":
                    return False
                raise
            return True

        if not self._call("PutObject", key, conditional_put):
            return False
        # The server said 200; prove the object holds our bytes (it may ignore If-None-Match).
        if self.get_bytes(key) != data:
            log.warning("conditional_put_lost", key=key, store=self.url,
                        cause="object differs after a successful conditional put")
            return False
        return True

    def delete(self, keys: Iterable[str]) -> None:
        batch = [self._key(k) for k in keys]
        for i in range(0, len(batch), 1000):
            chunk = batch[i:i + 1000]

            def delete_chunk(chunk: list[str] = chunk) -> None:
                resp = self.client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": k} for k in chunk], "Quiet": True})
                errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
                if errors:
                    status = 403 if errors[0].get("Code") == "AccessDenied" else 500
                    raise ClientError(cast(Any, {"Error": errors[0], "ResponseMetadata": {
                        "HTTPStatusCode": status}}), "DeleteObjects")

            self._call("DeleteObjects", chunk[0][len(self.prefix):], delete_chunk)

    # -- resumable multipart uploads ---------------------------------------------------------

    @contextmanager
    def upload_journal(self, path: str | Path) -> Iterator[UploadJournal]:
        """Within the block, this thread's multipart uploads are journaled in the file `path`
        (created when an upload begins, deleted when none is left unfinished), so that they are
        resumed by a later attempt in this process or the next one."""
        journal = UploadJournal(path)
        previous = getattr(self._local, "journal", None)
        self._local.journal = journal
        try:
            yield journal
        finally:
            self._local.journal = previous

    def abort_journaled_uploads(self, path: str | Path, cause: str) -> int:
        """Aborts the unfinished uploads recorded in the journal file `path` (their checkpoint
        was abandoned) and forgets them; returns how many. One the server cannot be told about
        now stays in the journal."""
        journal = UploadJournal(path)
        n = 0
        for name, rec in journal.records().items():
            bucket, _, full = name.partition("/")
            if bucket == self.bucket and self._abort_upload(full, rec["upload_id"], cause):
                journal.drop(name)
                n += 1
        return n

    def _current_journal(self) -> UploadJournal:
        journal = getattr(self._local, "journal", None)
        return journal if journal is not None else self._journal

    def _part_size(self, size: int) -> int:
        wanted = max(int(self.transfer.multipart_chunksize), MIN_PART,
                     math.ceil(size / MAX_PARTS))
        return min(wanted, MAX_PART)

    def _put_multipart(self, path: Path, full: str) -> None:
        """One attempt: continue the journaled upload of `full` (or begin one), send the parts
        the server lacks, complete. Botocore errors escape to `_call`, which retries."""
        journal = self._current_journal()
        name = f"{self.bucket}/{full}"
        st = path.stat()
        identity = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        rec = journal.get(name)
        if rec is not None and any(rec.get(k) != v for k, v in identity.items()):
            self._abort_upload(full, rec["upload_id"], "the local file changed since its upload "
                               "began")
            journal.drop(name)
            rec = None
        for _ in range(2):  # at most one fresh start when the server forgot the upload
            fresh = rec is None
            if rec is None:
                resp = self.client.create_multipart_upload(Bucket=self.bucket, Key=full)
                rec = {"upload_id": resp["UploadId"], "part_size": self._part_size(st.st_size),
                       "started": round(time.time(), 3), **identity}
                journal.put(name, rec)
            upload_id, part_size = str(rec["upload_id"]), int(rec["part_size"])
            try:
                stored = {} if fresh else self._stored_parts(full, upload_id)
                self._send_missing_and_complete(path, full, rec, stored, resumed=not fresh)
            except _UploadGone as gone:
                journal.drop(name)
                if gone.denied:
                    self._abort_upload(full, upload_id, "its parts cannot be listed")
                elif self._already_complete(path, full, st.st_size, part_size):
                    log.info("multipart_already_complete", key=full, upload_id=upload_id)
                    return
                log.warning("multipart_restarted", key=full, upload_id=upload_id,
                            cause="not allowed to list the upload's parts "
                                  "(s3:ListMultipartUploadParts); starting over" if gone.denied
                            else "the server no longer knows the upload (aborted, expired or "
                                 "lost); starting over")
                rec = None
                continue
            journal.drop(name)
            self._abort_leftovers(full)
            return
        raise StorageError(f"MultipartUpload s3://{self.bucket}/{full}: the server forgot two "
                           "fresh multipart uploads in a row; is a lifecycle rule aborting "
                           "incomplete uploads at once?")

    def _stored_parts(self, full: str, upload_id: str) -> dict[int, tuple[int, str]]:
        """Part number -> (size, ETag without quotes) of what the server holds."""
        out: dict[int, tuple[int, str]] = {}
        try:
            pages = self.client.get_paginator("list_parts").paginate(
                Bucket=self.bucket, Key=full, UploadId=upload_id)
            for page in pages:
                for part in page.get("Parts", []):
                    out[int(part["PartNumber"])] = (int(part["Size"]), part["ETag"].strip('"'))
        except ClientError as e:
            if _upload_gone(e):
                raise _UploadGone(upload_id) from e
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 403:
                raise _UploadGone(upload_id, denied=True) from e
            raise
        return out

    def _send_missing_and_complete(self, path: Path, full: str, rec: dict[str, Any],
                                   stored: dict[int, tuple[int, str]], resumed: bool) -> None:
        """Keeps the stored parts whose size and MD5 match the local bytes, sends the others."""
        size, part_size, upload_id = int(rec["size"]), int(rec["part_size"]), rec["upload_id"]
        count = max(1, math.ceil(size / part_size))
        etags: dict[int, str] = {}
        if stored:
            with open(path, "rb") as fh:
                for number, (stored_size, etag) in sorted(stored.items()):
                    offset = (number - 1) * part_size
                    length = min(part_size, size - offset)
                    if number > count or stored_size != length:
                        continue
                    fh.seek(offset)
                    if _md5(fh.read(length)).hexdigest() == etag:
                        etags[number] = f'"{etag}"'
        missing = [n for n in range(1, count + 1) if n not in etags]
        if resumed:
            log.info("multipart_resumed", key=full, upload_id=upload_id, parts=count,
                     kept=len(etags), sending=len(missing))
        etags.update(self._send_parts(path, full, upload_id, part_size, size, missing))
        try:
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etags[n]}
                                           for n in sorted(etags)]})
        except ClientError as e:
            if _upload_gone(e):
                raise _UploadGone(upload_id) from e
            raise

    def _send_parts(self, path: Path, full: str, upload_id: str, part_size: int, size: int,
                    numbers: builtins.list[int]) -> dict[int, str]:
        """Uploads these parts, at most `max_concurrency` at a time (and so in memory); on the
        first failure no further part starts, and the error is raised once the running ones end."""
        stop = threading.Event()

        def send(number: int) -> str | None:
            if stop.is_set():
                return None
            offset = (number - 1) * part_size
            length = min(part_size, size - offset)
            with open(path, "rb") as fh:
                fh.seek(offset)
                data = fh.read(length)
            if len(data) != length:
                raise OSError(f"{path} is shorter than when its upload began (was it rewritten?)")
            digest = _md5(data).digest()
            if self._pacer is not None:
                self._pacer.take(length)
            if stop.is_set():
                return None
            try:
                resp = self.client.upload_part(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number,
                    Body=data, ContentMD5=base64.b64encode(digest).decode("ascii"))
            except ClientError as e:
                if _upload_gone(e):
                    raise _UploadGone(upload_id) from e
                raise
            return str(resp["ETag"])

        out: dict[int, str] = {}
        if not numbers:
            return out
        first_error: Exception | None = None
        with ThreadPoolExecutor(min(self.max_concurrency, len(numbers)),
                                thread_name_prefix="ds3d-s3-part") as pool:
            futures = {pool.submit(send, n): n for n in numbers}
            for fut in as_completed(futures):
                try:
                    etag = fut.result()
                except Exception as e:  # raised below, once the parts in flight have ended
                    if first_error is None:
                        first_error = e
                        stop.set()
                    continue
                if etag is not None:
                    out[futures[fut]] = etag
        if first_error is not None:
            raise first_error
        return out

    def _already_complete(self, path: Path, full: str, size: int, part_size: int) -> bool:
        """Whether the object already holds this file as uploaded in `part_size` parts (an
        earlier CompleteMultipartUpload went through but its answer was lost): its multipart
        ETag is the MD5 of the parts' MD5s, then '-' and the part count."""
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=full)
        except ClientError as e:
            if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise
        count = max(1, math.ceil(size / part_size))
        etag = str(head.get("ETag", "")).strip('"')
        if int(head.get("ContentLength", -1)) != size or not etag.endswith(f"-{count}"):
            return False
        digests = b""
        with open(path, "rb") as fh:
            while chunk := fh.read(part_size):
                digests += _md5(chunk).digest()
        return etag == f"{_md5(digests).hexdigest()}-{count}"

    def _uploads_of(self, full: str) -> builtins.list[str]:
        """UploadIds of the unfinished multipart uploads of exactly this key."""
        out = []
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.bucket, Prefix=full)
        for page in pages:
            out += [u["UploadId"] for u in page.get("Uploads", []) if u["Key"] == full]
        return out

    def _abort_leftovers(self, full: str) -> None:
        """After our upload of `full` completed: aborts any other unfinished upload of that key
        (one this uploader began, then lost track of when its process died). Best effort: the
        object is complete, so a failure here is logged, not raised."""
        try:
            leftovers = self._uploads_of(full)
        except _BOTO_ERRORS as e:
            log.warning("multipart_leftovers_unchecked", key=full, detail=str(e))
            return
        for upload_id in leftovers:
            self._abort_upload(full, upload_id, "left unfinished by an earlier attempt")

    def _abort_upload(self, full: str, upload_id: str, cause: str) -> bool:
        """Best effort (an upload left behind costs storage, not correctness): False, and a
        logged warning, when the server could not be told."""
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
        except (ClientError, BotoCoreError) as e:
            if isinstance(e, ClientError) and _upload_gone(e):
                return True
            log.warning("multipart_abort_failed", key=full, upload_id=upload_id, detail=str(e))
            return False
        log.info("multipart_aborted", key=full, upload_id=upload_id, cause=cause)
        return True

    # -- reads ------------------------------------------------------------------------------

    def get_file(self, key: str, local_path: str | Path) -> None:
        full = self._key(key)
        dest = Path(local_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".tmp-ds3d-{uuid.uuid4().hex}"
        try:
            self._call("GetObject", key, lambda: self.client.download_file(
                self.bucket, full, str(tmp), Config=self.transfer))
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)

    def get_bytes(self, key: str) -> bytes:
        full = self._key(key)
        data: bytes = self._call("GetObject", key, lambda: self.client.get_object(
            Bucket=self.bucket, Key=full)["Body"].read())
        return data

    def exists(self, key: str) -> bool:
        full = self._key(key)
        try:
            self._call("HeadObject", key, lambda: self.client.head_object(
                Bucket=self.bucket, Key=full))
        except NotFoundError:
            return False
        return True

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        def list_all() -> list[ObjectInfo]:
            out = []
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    modified = obj.get("LastModified")
                    out.append(ObjectInfo(obj["Key"][len(self.prefix):], int(obj["Size"]),
                                          modified.timestamp() if modified else 0.0))
            return out

        out = self._call("ListObjectsV2", None, list_all)
        out.sort(key=lambda o: o.key)
        return out

    def check_access(self) -> None:
        """List (proves the bucket exists and the signature is right), then write, read back and
        delete a probe object under the prefix (proves the permissions a checkpoint needs)."""
        self._call("ListObjectsV2", None, lambda: self.client.list_objects_v2(
            Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1))
        probe = f".ds3d-access-check-{uuid.uuid4().hex}"
        self.put_bytes(probe, b"ok")
        try:
            if self.get_bytes(probe) != b"ok":
                raise StorageError(f"{self.url}: a probe object read back differently; the "
                                   "endpoint is not a consistent S3 store")
        finally:
            self.delete([probe])

    # -- maintenance ------------------------------------------------------------------------

    def list_incomplete_uploads(self) -> builtins.list[tuple[str, str]]:
        """(key, upload id) of multipart uploads under the prefix never completed or aborted
        (left by a killed uploader; they cost storage until aborted)."""
        return [(key, upload_id) for key, upload_id, _ in self._incomplete_uploads()]

    def _incomplete_uploads(self) -> builtins.list[tuple[str, str, float]]:
        """(key, upload id, initiated unix s) of the unfinished multipart uploads."""
        def list_uploads() -> builtins.list[tuple[str, str, float]]:
            out = []
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self.prefix)
            for page in pages:
                for up in page.get("Uploads", []):
                    started = up.get("Initiated")
                    out.append((up["Key"][len(self.prefix):], up["UploadId"],
                                started.timestamp() if started else 0.0))
            return out

        return self._call("ListMultipartUploads", None, list_uploads)

    def abort_stale_uploads(self, keys_prefix: str, older_than: float) -> builtins.list[str]:
        """Aborts the unfinished multipart uploads under `keys_prefix` started before
        `older_than` (unix s): left by an uploader that died, they cost storage until aborted.
        A younger one may belong to an uploader still at work, so it is kept. Returns the keys."""
        aborted = []
        for key, upload_id, started in self._incomplete_uploads():
            if key.startswith(keys_prefix) and started < older_than and self._abort_upload(
                    self.prefix + key, upload_id, f"unfinished since {time.ctime(started)}: "
                    "cleanup"):
                aborted.append(key)
        return aborted

    def abort_incomplete_uploads(self, keys_prefix: str = "") -> int:
        """Aborts the incomplete multipart uploads whose key starts with `keys_prefix`; only safe
        when no uploader for those keys is running. Returns how many were aborted."""
        n = 0
        for key, upload_id in self.list_incomplete_uploads():
            if key.startswith(keys_prefix):
                def abort(k: str = key, u: str = upload_id) -> None:
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.prefix + k,
                                                       UploadId=u)

                self._call("AbortMultipartUpload", key, abort)
                n += 1
        return n
