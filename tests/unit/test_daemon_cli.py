"""ds3dctl's multi-node and fault-injection flags: `--hosts` becomes launch.hosts (and nnodes),
`inject` parses its kind/rank/step, and bad input is refused before anything is sent."""

import pytest

from ds3d.daemon import cli
from ds3d.trainer.config import build_job_config

pytestmark = pytest.mark.timeout(60)


def parse(*argv):
    return cli.build_parser().parse_args(list(argv))


def test_hosts_set_launch_hosts_and_nodes():
    a = parse("start", "tiny", "--dp", "2", "--hosts", "127.0.0.1:7531, unix:/run/b.sock",
              "--store", "file:///shared/ckpt")
    over = cli.start_overrides(a)
    assert 'launch.hosts=["127.0.0.1:7531", "unix:/run/b.sock"]' in over
    assert "launch.nnodes=2" in over
    cfg = build_job_config("tiny", over)
    assert cfg.launch.hosts == ["127.0.0.1:7531", "unix:/run/b.sock"] and cfg.launch.nnodes == 2
    # an explicit --nodes is kept (the daemon then checks that the counts agree)
    assert "launch.nnodes=2" not in cli.start_overrides(
        parse("start", "tiny", "--nodes", "3", "--hosts", "a:1,b:2"))
    with pytest.raises(cli.UsageError, match="--hosts"):
        cli.start_overrides(parse("start", "tiny", "--hosts", " , "))


def test_inject_parses():
    a = parse("inject", "j", "hang", "--rank", "3", "--at-step", "40")
    assert (a.job, a.kind, a.rank, a.at_step) == ("j", "hang", 3, 40)
    assert parse("inject", "j", "nan", "--rank", "0").at_step == 0  # 0: the next step
    with pytest.raises(cli.UsageError, match="invalid choice"):
        parse("inject", "j", "melt", "--rank", "0")
    with pytest.raises(cli.UsageError, match="--rank"):
        parse("inject", "j", "crash")
