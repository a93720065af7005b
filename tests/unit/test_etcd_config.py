"""`launch.rendezvous`: the etcd rendezvous setting is validated strictly at the edge, and what it
selects (torch elastic's backend, its settings, the run id) is decided in one place each. No
processes: the live checks against a real etcd are in tests/integration/test_etcd_rendezvous.py.
"""

from __future__ import annotations

import pytest

from ds3d.daemon.launcher import ETCD_RDZV_CONFIGS, RDZV_CONFIGS
from ds3d.daemon.rendezvous import ETCD_BACKEND, etcd_problem, rendezvous_run_id
from ds3d.trainer.config import build_job_config
from ds3d.trainer.errors import ConfigError


@pytest.mark.parametrize("value, endpoints", [
    ("etcd://127.0.0.1:2379", [("127.0.0.1", 2379)]),
    ("etcd://etcd-0.cluster.local:2379,10.0.0.6:12379,[fd00::1]:2379",
     [("etcd-0.cluster.local", 2379), ("10.0.0.6", 12379), ("[fd00::1]", 2379)]),
])
def test_etcd_members_are_read_in_order(value, endpoints):
    cfg = build_job_config("tiny", [f"launch.rendezvous={value}"])
    assert cfg.launch.rendezvous == value and cfg.launch.etcd_endpoints == endpoints


def test_absent_means_the_head_daemons_own_store():
    cfg = build_job_config("tiny")
    assert cfg.launch.rendezvous is None and cfg.launch.etcd_endpoints == []


@pytest.mark.parametrize("value, why", [
    ("http://127.0.0.1:2379", "is not an etcd URL; write etcd://HOST:PORT"),
    ("127.0.0.1:2379", "is not an etcd URL"),
    ("etcd://127.0.0.1", "'127.0.0.1' is not HOST:PORT"),
    ("etcd://", "'' is not HOST:PORT"),
    ("etcd://a:2379,", "'' is not HOST:PORT"),
    ("etcd://a:2379/v2", "is not HOST:PORT"),
    ("etcd://user@a:2379", "is not HOST:PORT"),
    ("etcd://a b:2379", "is not HOST:PORT"),
    ("etcd://a:0", "port 0 is outside 1-65535"),
    ("etcd://a:65536", "port 65536 is outside 1-65535"),
    ("etcd://a:123456", "is not HOST:PORT"),
    ("etcd://a:2379,a:2379", "listed more than once"),
    ("etcd://" + ",".join(f"h{i}:2379" for i in range(17)), "at most 16"),
])
def test_a_bad_rendezvous_is_refused_with_what_to_write(value, why):
    with pytest.raises(ConfigError) as e:
        build_job_config("tiny", [f"launch.rendezvous={value}"])
    assert "launch.rendezvous" in str(e.value) and why in str(e.value), str(e.value)


def test_a_rendezvous_on_two_lines_is_refused():
    with pytest.raises(ConfigError, match="launch.rendezvous.*control character U\\+000A"):
        build_job_config("tiny", ["launch.rendezvous=etcd://a:2379\netcd://b:2379"])


def test_etcd_uses_the_dynamic_rendezvous_with_the_c10d_timings():
    assert ETCD_BACKEND == "etcd-v2"  # the legacy "etcd" rendezvous has no keep-alive
    assert "is_host" not in ETCD_RDZV_CONFIGS  # c10d's alone
    assert {k: v for k, v in ETCD_RDZV_CONFIGS.items() if k != "keep_alive_max_attempt"} == \
        {k: v for k, v in RDZV_CONFIGS.items() if k not in ("is_host", "keep_alive_max_attempt")}


def test_an_etcd_run_id_names_the_job_instance():
    job_id = "0123456789abcdef0123456789abcdef"
    assert rendezvous_run_id("mn", 2, job_id, etcd=False) == "mn-a2"  # the default, unchanged
    assert rendezvous_run_id("mn", 2, job_id, etcd=True) == "mn-0123456789ab-a2"
    assert rendezvous_run_id("mn", 2, "", etcd=True) == "mn-a2"


def test_python_etcd_imports_for_torch_elastic():
    import etcd  # torch falls back to a stub that fails at first use when it is missing
    from torch.distributed.elastic.rendezvous import etcd_rendezvous_backend

    assert etcd_rendezvous_backend.etcd is etcd


def test_a_closed_port_is_named_as_not_answering():
    import socket

    with socket.socket() as s:  # bound, not listening: a connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert etcd_problem("127.0.0.1", port, timeout_s=1) == \
            f"etcd at 127.0.0.1:{port} does not answer ([Errno 111] Connection refused)"
