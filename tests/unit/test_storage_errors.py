"""botocore/boto3 failures map onto ds3d's errors in one place (`classify_error`): credential and
configuration mistakes are terminal and say what to fix; outages are `TransientStorageError`.

Credential checks use moto in-process with authentication switched on (real ClientErrors from
moto's signature check and IAM policies); the outage case uses a closed loopback port."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
import structlog
from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)
from moto import mock_aws
from moto import settings as moto_settings
from moto.core.responses import ActionAuthenticatorMixin

from ds3d.checkpoints.s3_storage import ENDPOINT_ENV, S3Storage, classify_error
from ds3d.checkpoints.storage import open_storage
from ds3d.trainer.errors import (
    ConfigError,
    NotFoundError,
    PermissionError_,
    StorageError,
    TransientStorageError,
)

pytest_plugins = ["fixtures.s3"]
pytestmark = pytest.mark.timeout(60)


def client_error(code: str, status: int, op: str = "PutObject") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": f"{code} message"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, op)


@pytest.mark.parametrize(("code", "status", "key", "expected", "hint"), [
    ("SignatureDoesNotMatch", 403, "k", PermissionError_, "AWS_SECRET_ACCESS_KEY"),
    ("InvalidAccessKeyId", 403, "k", PermissionError_, "AWS_ACCESS_KEY_ID"),
    ("AccessDenied", 403, "k", PermissionError_, "s3:PutObject"),
    ("ExpiredToken", 400, "k", PermissionError_, "refresh"),
    ("RequestTimeTooSkewed", 403, "k", PermissionError_, "clock"),
    ("403", 403, "k", PermissionError_, "credentials"),          # HEAD: no body, status only
    ("NoSuchBucket", 404, "k", NotFoundError, "create it"),
    ("404", 404, None, NotFoundError, "create it"),               # HEAD bucket
    ("NoSuchKey", 404, "k", NotFoundError, "no such object"),
    ("404", 404, "k", NotFoundError, "no such object"),           # HEAD object
    ("InternalError", 500, "k", TransientStorageError, "retry"),
    ("ServiceUnavailable", 503, "k", TransientStorageError, "retry"),
    ("SlowDown", 503, "k", TransientStorageError, "retry"),
    ("502", 502, "k", TransientStorageError, "retry"),
    ("RequestTimeout", 400, "k", TransientStorageError, "retry"),
    ("PermanentRedirect", 301, "k", StorageError, "region"),
    ("InvalidArgument", 400, "k", StorageError, "InvalidArgument"),
])
def test_client_errors(code: str, status: int, key: str | None, expected: type, hint: str) -> None:
    err = classify_error(client_error(code, status), op="PutObject", bucket="bkt", key=key)
    assert type(err) is expected
    assert hint in str(err)
    assert err.retryable is (expected is TransientStorageError)


def test_connection_errors_are_transient() -> None:
    for exc in (EndpointConnectionError(endpoint_url="http://x"),
                ConnectTimeoutError(endpoint_url="http://x"),
                ReadTimeoutError(endpoint_url="http://x")):
        err = classify_error(exc, op="GetObject", bucket="bkt", key="k", endpoint="http://x")
        assert isinstance(err, TransientStorageError), exc
        assert "cannot reach" in str(err)


def test_no_credentials_is_permission() -> None:
    err = classify_error(NoCredentialsError(), op="ListObjectsV2", bucket="bkt")
    assert isinstance(err, PermissionError_) and "AWS_ACCESS_KEY_ID" in str(err)


def test_transfer_wrapper_is_unwrapped() -> None:
    try:
        try:
            raise client_error("SignatureDoesNotMatch", 403, "UploadPart")
        except ClientError as inner:
            raise S3UploadFailedError("Failed to upload x to bkt/k: ...") from inner
    except S3UploadFailedError as outer:
        err = classify_error(outer, op="PutObject", bucket="bkt", key="k")
    assert isinstance(err, PermissionError_) and "SignatureDoesNotMatch" in str(err)


# -- real errors from moto with authentication on --------------------------------------------


@pytest.fixture
def moto_auth(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """moto in-process with signature and IAM checks: a user allowed only to list, and a bucket.
    (What moto's `set_initial_no_auth_action_count(4)` does: the first 4 requests set it up.)"""
    policy = {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Action": ["s3:ListBucket", "s3:CreateBucket"], "Resource": "*"}]}
    monkeypatch.setattr(moto_settings, "INITIAL_NO_AUTH_ACTION_COUNT", 4)
    monkeypatch.setattr(ActionAuthenticatorMixin, "request_count", 0)
    with mock_aws():
        if True:
            iam = boto3.client("iam")
            iam.create_user(UserName="ranks")
            iam.put_user_policy(UserName="ranks", PolicyName="list-only",
                                PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName="ranks")["AccessKey"]
            creds = {"access_key": key["AccessKeyId"], "secret_key": key["SecretAccessKey"]}
            boto3.client("s3", aws_access_key_id=creds["access_key"],
                         aws_secret_access_key=creds["secret_key"]).create_bucket(Bucket="bkt")
            yield creds


def _check(bucket: str, **creds: Any) -> Exception:
    storage = S3Storage(bucket, "job", outage_retries=0, max_attempts=1, **creds)
    with pytest.raises(Exception) as info:
        storage.check_access()
    return info.value


def test_wrong_secret_key(moto_auth: dict[str, str]) -> None:
    err = _check("bkt", access_key=moto_auth["access_key"], secret_key="wrong-secret")
    assert isinstance(err, PermissionError_)
    assert "SignatureDoesNotMatch" in str(err) and "AWS_SECRET_ACCESS_KEY" in str(err)
    assert not err.retryable


def test_unknown_access_key(moto_auth: dict[str, str]) -> None:
    err = _check("bkt", access_key="AKIAUNKNOWNUNKNOWN00", secret_key="x")
    assert isinstance(err, PermissionError_) and "InvalidAccessKeyId" in str(err)


def test_missing_permission_found_before_any_write(moto_auth: dict[str, str]) -> None:
    err = _check("bkt", **moto_auth)  # may list, may not put
    assert isinstance(err, PermissionError_)
    assert "AccessDenied" in str(err) and "s3:PutObject" in str(err)


def test_missing_bucket(moto_auth: dict[str, str]) -> None:
    err = _check("no-such-bucket", **moto_auth)
    assert isinstance(err, NotFoundError)
    assert "'no-such-bucket' does not exist" in str(err) and "create it" in str(err)


def test_missing_bucket_on_moto_server(moto_server: Any, aws_env: None) -> None:
    storage = moto_server.storage("ds3d-never-created")
    with pytest.raises(NotFoundError, match="create it or fix"):
        storage.check_access()


def test_no_credentials_anywhere(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", raising=False)
    with pytest.raises(PermissionError_, match="no usable S3 credentials"):
        S3Storage("bkt", endpoint_url="http://127.0.0.1:9", outage_retries=0).check_access()


# -- outages -----------------------------------------------------------------------------------


def closed_port() -> int:
    from fixtures.s3 import free_port

    return free_port()  # bound then released: nothing listens there


def test_closed_port_is_an_outage_and_retried(aws_env: None) -> None:
    storage = S3Storage("bkt", "job", endpoint_url=f"http://127.0.0.1:{closed_port()}",
                        max_attempts=1, outage_retries=2, backoff_base=0.01, connect_timeout=1)
    t0 = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(TransientStorageError, match="cannot reach the S3 endpoint") as info:
            storage.check_access()
    assert info.value.retryable
    assert [e["event"] for e in logs] == ["storage_retry", "storage_retry"]
    assert time.monotonic() - t0 < 10


def test_outage_then_recovery_is_invisible(aws_env: None) -> None:
    storage = S3Storage("bkt", endpoint_url="http://127.0.0.1:9", outage_retries=3,
                        backoff_base=0.01)
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
        return "done"

    assert storage._call("GetObject", "k", flaky) == "done"
    assert len(calls) == 3


def test_terminal_errors_are_not_retried(aws_env: None) -> None:
    storage = S3Storage("bkt", endpoint_url="http://127.0.0.1:9", outage_retries=3,
                        backoff_base=0.01)
    calls = []

    def denied() -> None:
        calls.append(1)
        raise client_error("AccessDenied", 403)

    with pytest.raises(PermissionError_):
        storage._call("PutObject", "k", denied)
    assert len(calls) == 1


# -- configuration ---------------------------------------------------------------------------


def test_endpoint_from_env(aws_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENDPOINT_ENV, "http://127.0.0.1:1234")
    assert S3Storage("bkt").endpoint == "http://127.0.0.1:1234"
    monkeypatch.delenv(ENDPOINT_ENV)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:4321")
    assert S3Storage("bkt").client.meta.endpoint_url == "http://127.0.0.1:4321"


def test_urls(aws_env: None, tmp_path: Any) -> None:
    s = open_storage("s3://my-bucket/jobs/a/", endpoint_url="http://127.0.0.1:9")
    assert isinstance(s, S3Storage) and (s.bucket, s.prefix) == ("my-bucket", "jobs/a/")
    assert s.url == "s3://my-bucket/jobs/a"
    with pytest.raises(ConfigError, match="3 to 63"):
        open_storage("s3://ab/x")
    with pytest.raises(ConfigError, match="file:///"):
        open_storage("gs://b/p")
    with pytest.raises(ConfigError, match="three slashes"):
        open_storage("file://relative/path")
    assert open_storage(f"file://{tmp_path}").url == f"file://{tmp_path}"
