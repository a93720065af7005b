"""A node's shares refuse the writes of a deposed leader (etcd mode, daemon/peers.py Shares):
once a node has seen a leader's lease token for a job, a call carrying a lower token (a leader
that was frozen past its lease and sends late) is refused; 0 (c10d mode, one fixed head) is
never fenced, and another job of the same name starts its tokens afresh."""

from __future__ import annotations

import pytest

from ds3d.daemon.jobdir import JobDir
from ds3d.daemon.peers import Shares
from ds3d.trainer.config import build_job_config
from ds3d.trainer.errors import StateError


@pytest.fixture
def shares(tmp_path):
    shares = Shares(tmp_path / "shares", launcher=None)  # type: ignore[arg-type]
    JobDir(shares.root, "fo").create(build_job_config("tiny", name="fo").dump_json())
    return shares


def test_a_lower_token_than_one_seen_is_refused(shares):
    command = shares.root / "fo" / "control" / "command.json"
    assert shares.control("fo", "command.json", '{"id": 1}', leader_token=8)
    assert shares.control("fo", "command.json", '{"id": 2}', leader_token=97)  # a successor
    with pytest.raises(StateError, match=r"deposed leader \(lease token 8\).*token 97"):
        shares.control("fo", "command.json", '{"id": 3}', leader_token=8)
    assert command.read_text() == '{"id": 2}'  # the late write did not land
    with pytest.raises(StateError, match="StopShare"):
        shares.stop("fo", now=True, leader_token=8)
    assert shares.control("fo", "command.json", '{"id": 4}', leader_token=97)
    assert not shares.stop("fo", now=True, leader_token=97)  # no agent here: nothing to stop


def test_unfenced_calls_and_a_new_job_of_the_same_name(shares):
    assert shares.control("fo", "command.json", '{"id": 1}')  # c10d mode: token 0
    assert shares.control("fo", "command.json", '{"id": 1}', leader_token=50)
    assert shares.control("fo", "command.json", '{"id": 2}')  # 0 is never fenced
    # a StartShare of another job named fo (another run id prefix) forgets the old tokens
    shares._fence("fo", 7, "StartShare", run_id_prefix="fo-0123456789ab")
    assert shares.control("fo", "command.json", '{"id": 3}', leader_token=7)
    with pytest.raises(StateError):
        shares.control("fo", "command.json", '{"id": 4}', leader_token=6)
