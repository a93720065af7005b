"""A StartShare whose launch fields are malformed is refused before this node's share of the job
is touched (daemon/api.py check_share_request). Before, `rdzv_endpoint="a:b:c"`, `attempt=-5`
or a run id of another job were taken as they came: the node ended its running agent of the
job, and started one that crashed in torch elastic's endpoint parser."""

from __future__ import annotations

import pytest

from ds3d.daemon.api import ControlServicer, check_share_request
from ds3d.daemon.peers import Shares
from ds3d.trainer.config import build_job_config
from ds3d.trainer.errors import ConfigError
from ds3d.v1 import control_pb2 as pb

GOOD = {"head_node": "head", "rdzv_endpoint": "127.0.0.1:29500", "run_id": "sj-a1",
        "attempt": 1}


@pytest.mark.parametrize("change, phrase", [
    ({"rdzv_endpoint": "a:b:c"}, "rdzv_endpoint='a:b:c': HOST:PORT"),
    ({"rdzv_endpoint": "127.0.0.1:0"}, "a port from 1 to 65535"),
    ({"rdzv_endpoint": "127.0.0.1:655350"}, "a port from 1 to 65535"),
    ({"rdzv_endpoint": ":29500"}, "HOST:PORT"),
    ({"attempt": -5, "run_id": "sj-a-5"}, "attempt=-5: the head's launch attempt, 1 or more"),
    ({"run_id": "../../x"}, "run_id='../../x': sj-a1"),
    ({"run_id": "other-a1"}, "run_id='other-a1'"),
    ({"run_id": "sj-a2"}, "run_id='sj-a2': sj-a1"),
    ({"head_node": ""}, "head_node=''"),
])
def test_a_malformed_start_share_leaves_the_node_as_it_was(tmp_path, change, phrase):
    shares = Shares(tmp_path / "shares", launcher=None)  # type: ignore[arg-type]
    servicer = ControlServicer(service=None, shares=shares, node="node2")  # type: ignore[arg-type]
    request = pb.StartShareRequest(config_json=build_job_config("tiny", name="sj").dump_json(),
                                   **{**GOOD, **change})
    with pytest.raises(ConfigError) as err:
        servicer.StartShare(request, context=None)  # type: ignore[arg-type]
    assert phrase in str(err.value) and "share was left as it was" in str(err.value)
    assert not (tmp_path / "shares" / "sj").exists()


@pytest.mark.parametrize("fields", [
    GOOD, {**GOOD, "rdzv_endpoint": "10.0.0.5:2379", "run_id": "sj-0123456789ab-a3",
           "attempt": 3},
    {**GOOD, "rdzv_endpoint": "::1:29500"},
])
def test_what_the_head_sends_is_accepted(fields):
    check_share_request(pb.StartShareRequest(**fields), "sj")
