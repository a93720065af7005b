"""The durable tier's contract: a small key/value object store with `str` keys.

Every backend (`FileStorage` for `file://`, `S3Storage` for `s3://`) passes the same conformance
suite (tests/integration/test_s3_conformance.py: file, moto_server and Ceph RGW), so checkpoint
code never asks which one it has.

Guarantees every backend gives:
- keys are `/`-separated and relative to the store's own prefix (the URL's path);
- a reader never sees a partly written object (writes are atomic per object);
- `put_bytes(..., if_absent=True)` creates the key only if it does not exist and says whether it
  did; backends that cannot trust the server's condition read the object back to check;
- a missing key raises `NotFoundError`; outages raise `TransientStorageError` (worth retrying);
  wrong credentials or permissions raise `PermissionError_`; anything else `StorageError`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

from .errors import ConfigError


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    # unix seconds of the last write (0 when the backend does not say); not part of equality
    mtime: float = field(default=0.0, compare=False)


@runtime_checkable
class Storage(Protocol):
    url: str

    def put_file(self, local_path: str | Path, key: str) -> None:
        """Uploads a local file (large files in parts, with bounded memory)."""
        ...

    def get_file(self, key: str, local_path: str | Path) -> None:
        """Downloads to a temporary name beside `local_path`, then renames it into place."""
        ...

    def put_bytes(self, key: str, data: bytes, if_absent: bool = False) -> bool:
        """Writes a small object; with `if_absent`, returns False (writing nothing) if it exists."""
        ...

    def get_bytes(self, key: str) -> bytes: ...

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects whose key starts with `prefix`, sorted by key."""
        ...

    def delete(self, keys: Iterable[str]) -> None:
        """Deletes the keys; keys that do not exist are not an error."""
        ...

    def exists(self, key: str) -> bool: ...

    def check_access(self) -> None:
        """Proves up front that the store is reachable, exists and can be written, listed, read
        and deleted, so a misconfigured job fails before any worker starts."""
        ...


def open_storage(url: str, **options: Any) -> Storage:
    """`file:///abs/path` -> FileStorage, `s3://bucket/prefix` -> S3Storage (options go to it:
    endpoint_url, region, multipart_threshold, multipart_chunksize, max_concurrency, ...)."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"store {url!r}: a file URL needs an absolute path, "
                              "e.g. file:///data/ckpt (three slashes)")
        from .file_storage import FileStorage

        return FileStorage(Path(unquote(parsed.path)), **options)
    if parsed.scheme == "s3":
        from .s3_storage import S3Storage

        return S3Storage.from_url(url, **options)
    raise ConfigError(f"store {url!r}: use file:///absolute/path or s3://bucket/prefix")


def join_url(base: str, *parts: str) -> str:
    """`s3://b/p` + `x` -> `s3://b/p/x` (for a job's own prefix inside a shared store)."""
    out = base.rstrip("/")
    for part in parts:
        out += "/" + part.strip("/")
    return out


def job_store_url(store: str | None, job: str, run_dir: str | Path) -> str:
    """A job's own prefix in the durable tier: `checkpoint.store` + the job name; the embedded
    default is a folder in the job's run directory on this node."""
    return join_url(store or f"file://{Path(run_dir).resolve()}/store", job)
