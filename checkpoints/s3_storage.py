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

Large files go through boto3's transfer manager: multipart above `multipart_threshold`, parts of
`multipart_chunksize` sent by at most `max_concurrency` threads, and at most
`2 * max_concurrency` parts buffered, so memory stays bounded whatever the file size;
`max_bandwidth` (bytes/s) keeps uploads from starving the training's own network traffic.

Conditional create (`put_bytes(if_absent=True)`) sends `If-None-Match: *`, and then ALWAYS reads
the object back: some S3 servers (JuiceFS, rclone gateways; RGW on multipart completion)
silently ignore the condition, so the server's 200 alone proves nothing.
"""

from __future__ import annotations

import builtins
import os
import random
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlparse

import boto3
import structlog
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
)
from s3transfer.exceptions import RetriesExceededError

from ds3d.trainer.errors import (
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
                    "the bucket and s3:GetObject, s3:PutObject, s3:DeleteObject on the prefix",
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

    @classmethod
    def from_url(cls, url: str, **options: Any) -> "S3Storage":
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ConfigError(f"store {url!r}: expected s3://bucket/prefix")
        return cls(parsed.netloc, parsed.path, **options)

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
        full = self._key(key)
        self._call("PutObject", key, lambda: self.client.upload_file(
            str(local_path), self.bucket, full, Config=self.transfer))

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
        return self._call("GetObject", key, lambda: self.client.get_object(
            Bucket=self.bucket, Key=full)["Body"].read())

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
                    out.append(ObjectInfo(obj["Key"][len(self.prefix):], int(obj["Size"])))
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
        def list_uploads() -> builtins.list[tuple[str, str]]:
            out = []
            pages = self.client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self.prefix)
            for page in pages:
                for up in page.get("Uploads", []):
                    out.append((up["Key"][len(self.prefix):], up["UploadId"]))
            return out

        return self._call("ListMultipartUploads", None, list_uploads)

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
