"""Job identity in the store (checkpoints/identity.py) on a real file store: a prefix has one
owner, and a job never loads, overwrites or deletes a checkpoint that names another job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds3d.checkpoints import layout
from ds3d.checkpoints.catalog import Catalog, CkptState
from ds3d.checkpoints.identity import (
    ForeignPrefixError,
    claim_prefix,
    local_job_id,
    new_job_id,
    read_owner,
    write_local_job_id,
)
from ds3d.checkpoints.storage import Storage, join_url, open_storage
from ds3d.checkpoints.upload import commit_checkpoint, upload_rank_files

from fixtures.ckpt import meta_for, write_fake_checkpoint


def commit(storage: Storage, local: Path, step: int, job: str, job_id: str | None) -> None:
    files = write_fake_checkpoint(local, step)[0]
    upload_rank_files(storage, step, 0, local, files, job_id=job_id)
    meta = meta_for(step, job=job).model_copy(update={"job_id": job_id})
    commit_checkpoint(storage, step, 1, meta, timeout=5)


def test_a_prefix_is_claimed_once_and_refused_to_another_job(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path}/store/a")
    a, b = new_job_id(), new_job_id()
    assert claim_prefix(storage, a, "a").job_id == a
    assert claim_prefix(storage, a, "a").job_id == a  # repeatable by its owner
    with pytest.raises(ForeignPrefixError) as e:
        claim_prefix(storage, b, "b")
    assert a in str(e.value) and b in str(e.value) and "'a'" in str(e.value)
    assert read_owner(storage).job_id == a  # type: ignore[union-attr]


def test_a_name_that_aliases_another_cannot_touch_its_checkpoints(tmp_path: Path) -> None:
    """Issue 17 item 3 at the store level: "nl\\n" and "nl" reach one prefix (the URL parser
    drops the newline). Whatever the names, job ids keep the jobs apart."""
    base = f"file://{tmp_path}/store"
    owner, alias = open_storage(join_url(base, "nl")), open_storage(join_url(base, "nl\n"))
    assert owner.url == alias.url  # the aliasing itself: one prefix for two names
    nl_id, alias_id = new_job_id(), new_job_id()
    claim_prefix(owner, nl_id, "nl")
    commit(owner, tmp_path / "local-nl", 10, "nl", nl_id)
    commit(owner, tmp_path / "local-nl", 20, "nl", nl_id)
    before = sorted(o.key for o in owner.list())

    with pytest.raises(ForeignPrefixError, match="belongs to job 'nl'"):
        claim_prefix(alias, alias_id, "nl\n")
    skipped: list[tuple[int, str]] = []
    catalog = Catalog(alias, tmp_path / "local-alias", job_id=alias_id,
                      on_skip=lambda step, cause, _: skipped.append((step, cause)))
    assert catalog.newest_restorable() is None  # loads nothing of the other job
    assert skipped == [(20, "foreign"), (10, "foreign")]
    assert {c.state for c in catalog.list()} == {CkptState.FOREIGN}
    with pytest.raises(ForeignPrefixError):
        catalog.delete(10, force=True)
    assert catalog.apply_retention(keep_last=1).deleted == []  # foreign steps are not its own
    assert catalog.sweep(grace_s=0).steps == []
    files = write_fake_checkpoint(tmp_path / "local-alias", 20)[0]
    with pytest.raises(ForeignPrefixError, match="not overwritten"):
        upload_rank_files(alias, 20, 0, tmp_path / "local-alias", files, job_id=alias_id)
    assert sorted(o.key for o in owner.list()) == before  # nothing changed in the store

    # the owner still restores its own newest checkpoint
    found = Catalog(owner, tmp_path / "restore", job_id=nl_id).newest_restorable()
    assert found is not None and found.step == 20 and found.manifest.job_id == nl_id


def test_manifests_of_older_versions_belong_to_the_prefix_owner(tmp_path: Path) -> None:
    """Rule for manifests without a job id: whoever owns the prefix (the first job of this
    version to write there claims it), so a job upgraded in place keeps its checkpoints."""
    storage = open_storage(f"file://{tmp_path}/store/old")
    commit(storage, tmp_path / "local", 5, "old", None)  # as an older version wrote it
    manifest = json.loads(storage.get_bytes(layout.manifest_key(5)))
    assert manifest["job_id"] is None
    mine = new_job_id()
    claim_prefix(storage, mine, "old")
    found = Catalog(storage, tmp_path / "restore", job_id=mine).newest_restorable()
    assert found is not None and found.step == 5
    with pytest.raises(ForeignPrefixError):
        claim_prefix(storage, new_job_id(), "old")


def test_a_part_of_another_job_is_never_merged(tmp_path: Path) -> None:
    storage = open_storage(f"file://{tmp_path}/store/p")
    a, b = new_job_id(), new_job_id()
    files = write_fake_checkpoint(tmp_path / "local", 7, world_size=2)
    upload_rank_files(storage, 7, 0, tmp_path / "local", files[0], job_id=a)
    upload_rank_files(storage, 7, 1, tmp_path / "local", files[1], job_id=b)
    meta = meta_for(7, world_size=2, job="p").model_copy(update={"job_id": a})
    with pytest.raises(Exception, match="two jobs share the prefix"):
        commit_checkpoint(storage, 7, 2, meta, timeout=5)
    assert not storage.exists(layout.manifest_key(7))


def test_the_job_id_file_is_made_once(tmp_path: Path) -> None:
    assert local_job_id(tmp_path) is None
    made = local_job_id(tmp_path, create=True)
    assert made and local_job_id(tmp_path, create=True) == made
    write_local_job_id(tmp_path, made)  # same id: fine
    with pytest.raises(ForeignPrefixError):
        write_local_job_id(tmp_path, new_job_id())
