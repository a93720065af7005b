"""`FileStorage`: the `Storage` contract on a local or shared file system (`file:///path`).

Writes are atomic: data goes to a temporary file in the destination folder, is fsynced, then
renamed over the key (and the folder fsynced), so a crash leaves either the old object or the new
one, never a torn file. `put_bytes(if_absent=True)` links the finished temporary file to the key
with `os.link`, which fails if the key exists: a real create-if-absent even on NFS, without the
window a check-then-rename would have.

`put_file` does not duplicate bytes on one file system: the store's object is a hard link to
the local file (or, where links are refused, a reflink via FICLONE on file systems that share
extents, e.g. XFS or Btrfs), and a plain copy only across file systems. This is safe because
nothing rewrites a file in place once it has been stored: the checkpoint writer writes every
save into a new tag folder (temp file + rename, a new inode each time), retention deletes
files (a link keeps the store's bytes alive when the local copy goes) and the store replaces
objects by rename. The bytes, hence the sha256 in the manifest, are the local file's.
"""

from __future__ import annotations

import builtins  # `list` in this class's signatures would name its list() method
import errno
import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .disk_space import is_disk_full, shortage
from .errors import NotFoundError, PermissionError_, StorageError
from .storage import ObjectInfo

_TMP_PREFIX = ".tmp-ds3d-"
_COPY_CHUNK = 8 << 20
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
# a link (or a reflink) is refused for these reasons; a copy still works
_NO_SHARING = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP,
               errno.ENOSYS, errno.EINVAL, errno.ENOTTY, errno.EACCES}


class FileStorage:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_absolute():
            raise StorageError(f"file store {root!s} must be an absolute path")
        self.url = f"file://{self.root}"
        self.last_put: str = ""  # how the last put_file stored its bytes: link, reflink, copy

    def __repr__(self) -> str:
        return f"FileStorage({self.url!r})"

    # -- paths ------------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise StorageError(f"invalid object key {key!r}")
        if parts[-1].startswith(_TMP_PREFIX):
            raise StorageError(f"object key {key!r} uses a reserved name")
        return self.root.joinpath(*parts)

    def _tmp_beside(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"

    # -- writes -----------------------------------------------------------------------------

    def put_file(self, local_path: str | Path, key: str) -> None:
        """Stores the file as a hard link, else a reflink, else a copy (see the module
        docstring); `last_put` says which. The caller must not rewrite `local_path` in place
        afterwards (a new file renamed over it is fine)."""
        dest = self._path(key)
        with _os_errors(f"upload {local_path} to {self.url}/{key}", where=dest,
                        needed=lambda: Path(local_path).stat().st_size):
            tmp = self._tmp_beside(dest)
            try:
                self.last_put = _share_or_copy(Path(local_path), tmp)
                os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_dir(dest.parent)

    def put_bytes(self, key: str, data: bytes, if_absent: bool = False) -> bool:
        dest = self._path(key)
        with _os_errors(f"write {self.url}/{key}", where=dest, needed=lambda: len(data)):
            tmp = self._tmp_beside(dest)
            try:
                with open(tmp, "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
                if if_absent:
                    try:
                        os.link(tmp, dest)
                    except FileExistsError:
                        return False
                else:
                    os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_dir(dest.parent)
            return True

    def delete(self, keys: Iterable[str]) -> None:
        for key in keys:
            path = self._path(key)
            with _os_errors(f"delete {self.url}/{key}"):
                path.unlink(missing_ok=True)
                self._prune_empty_dirs(path.parent)

    def _prune_empty_dirs(self, folder: Path) -> None:
        """Removes folders left empty by a delete, up to (not including) the root."""
        while folder != self.root and self.root in folder.parents:
            try:
                folder.rmdir()
            except OSError:
                return
            folder = folder.parent

    # -- reads ------------------------------------------------------------------------------

    def _inside(self, path: Path) -> bool:
        """The file a key reaches resolves inside the store: a symbolic link that ds3d never
        writes, pointing elsewhere, is not an object of this store."""
        return path.resolve().is_relative_to(self.root.resolve())

    def _readable(self, key: str) -> Path:
        path = self._path(key)
        if path.exists() and not self._inside(path):
            raise NotFoundError(f"{self.url}/{key} is a link to a file outside the store; ds3d "
                                "reads no object through it")
        return path

    def get_file(self, key: str, local_path: str | Path) -> None:
        src = self._readable(key)
        dest = Path(local_path)
        with _os_errors(f"download {self.url}/{key}", key=key):
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.parent / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
            try:
                with open(src, "rb") as s, open(tmp, "wb") as d:
                    shutil.copyfileobj(s, d, _COPY_CHUNK)
                    d.flush()
                    os.fsync(d.fileno())
                os.replace(tmp, dest)
            finally:
                tmp.unlink(missing_ok=True)

    def get_bytes(self, key: str) -> bytes:
        with _os_errors(f"read {self.url}/{key}", key=key):
            return self._readable(key).read_bytes()

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # Walk only the deepest folder the prefix names, not the whole store.
        head, _, _ = prefix.rpartition("/")
        start = self.root.joinpath(*head.split("/")) if head else self.root
        out: list[ObjectInfo] = []
        with _os_errors(f"list {self.url}/{prefix}"):
            for dirpath, _dirs, names in os.walk(start):
                for name in names:
                    if name.startswith(_TMP_PREFIX):
                        continue
                    full = Path(dirpath) / name
                    key = full.relative_to(self.root).as_posix()
                    if key.startswith(prefix) and (not full.is_symlink() or self._inside(full)):
                        try:
                            st = full.stat()
                            out.append(ObjectInfo(key, st.st_size, st.st_mtime))
                        except FileNotFoundError:
                            continue  # deleted while listing
        out.sort(key=lambda o: o.key)
        return out

    def sweep_temporaries(self, prefix: str, older_than: float) -> builtins.list[str]:
        """Removes the temporary files (`.tmp-ds3d-*`) of writes that never finished (a process
        killed mid-write) under `prefix` and last written before `older_than` (unix s); returns
        their paths relative to the root. `list` hides them, so nothing else ever would."""
        head, _, _ = prefix.rpartition("/")
        start = self.root.joinpath(*head.split("/")) if head else self.root
        removed: list[str] = []
        with _os_errors(f"clean up {self.url}/{prefix}"):
            for dirpath, _dirs, names in os.walk(start):
                for name in names:
                    full = Path(dirpath) / name
                    rel = full.relative_to(self.root).as_posix()
                    if not name.startswith(_TMP_PREFIX) or not rel.startswith(prefix):
                        continue
                    try:
                        if full.stat().st_mtime >= older_than:
                            continue
                        full.unlink()
                    except FileNotFoundError:
                        continue
                    removed.append(rel)
                    self._prune_empty_dirs(full.parent)
        return sorted(removed)

    def check_access(self) -> None:
        """Creates the root if needed and proves a write, read and delete work there."""
        with _os_errors(f"use {self.url}"):
            self.root.mkdir(parents=True, exist_ok=True)
        probe = f".ds3d-access-check-{uuid.uuid4().hex}"
        self.put_bytes(probe, b"ok")
        try:
            if self.get_bytes(probe) != b"ok":
                raise StorageError(f"{self.url}: a probe object read back differently")
        finally:
            self.delete([probe])


@contextmanager
def _os_errors(what: str, key: str | None = None, where: Path | None = None,
               needed: Callable[[], int] | None = None) -> Iterator[None]:
    """Maps OSError to the error hierarchy, naming the operation and what to fix; a full disk
    names the path, the bytes free there and the bytes the write needed (`where`, `needed`).
    The write's temporary file is already gone by then (each writer removes its own)."""
    try:
        yield
    except FileNotFoundError as exc:
        if key is not None:
            raise NotFoundError(f"cannot {what}: no such object") from exc
        raise StorageError(f"cannot {what}: {exc}") from exc
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise PermissionError_(f"cannot {what}: {exc.strerror}; give the job's user write "
                                   "access to that folder or choose another store") from exc
        if is_disk_full(exc):
            try:
                size = needed() if needed is not None else 0
            except OSError:
                size = 0
            short = shortage(where or Path("/"), size)
            raise StorageError(f"cannot {what}: {short.message('the store')}") from exc
        raise StorageError(f"cannot {what}: {exc}") from exc


def _share_or_copy(src: Path, tmp: Path) -> str:
    """Puts `src`'s bytes at the new path `tmp`: a hard link where the file system allows it,
    else a reflink (shared extents), else a copy. Returns "link", "reflink" or "copy". The data
    is fsynced either way; a link's mtime is set to now, as a copy's would be (the store's
    leftover sweep dates objects by it)."""
    with open(src, "rb") as fh:
        os.fsync(fh.fileno())  # a link shares the inode: its data must be durable too
    try:
        os.link(src, tmp)
    except OSError as exc:
        if exc.errno not in _NO_SHARING:
            raise
    else:
        os.utime(tmp, (time.time(), time.time()))
        return "link"
    with open(src, "rb") as s, open(tmp, "wb") as d:
        how = "copy"
        try:
            fcntl.ioctl(d.fileno(), _FICLONE, s.fileno())
            how = "reflink"
        except OSError as exc:
            if exc.errno not in _NO_SHARING:
                raise
            shutil.copyfileobj(s, d, _COPY_CHUNK)
        d.flush()
        os.fsync(d.fileno())
    return how


def _fsync_dir(folder: Path) -> None:
    """Makes a rename durable (the folder entry itself must reach the disk)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
