"""ds3dctl's command line: parsing, shorthand flags, one-line errors with exit code 2, and no
torch/deepspeed import."""

import subprocess
import sys

import pytest

from ds3d.daemon import cli

pytestmark = pytest.mark.timeout(60)


def parse(*argv):
    return cli.build_parser().parse_args(list(argv))


def test_start_shorthands_become_overrides():
    a = parse("start", "tiny", "--tp", "2", "--pp", "2", "--dp", "1", "--nodes", "1",
              "--steps", "7", "--store", "file:///tmp/x", "--set", "train.lr=1e-3")
    assert cli.start_overrides(a) == [
        "parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "launch.nnodes=1", "train.steps=7",
        'checkpoint.store="file:///tmp/x"', "train.lr=1e-3"]


def test_start_and_check_both_take_json():
    assert parse("start", "tiny", "--json").json and not parse("start", "tiny").json
    assert parse("check", "tiny", "--json").json


def test_commands_parse():
    assert parse("pause", "j", "--fast").fast
    assert parse("stop", "j", "--now").now
    assert parse("status", "--json").job is None
    assert parse("rollback", "j", "5").step == 5
    assert parse("events", "j", "-f").follow
    assert parse("list", "--all").all


def test_addr_from_environment(monkeypatch):
    monkeypatch.setenv("DS3D_ADDR", "unix:/tmp/x.sock")
    assert parse("list").addr == "unix:/tmp/x.sock"


@pytest.mark.parametrize("argv,needle", [
    (["rollback", "j", "five"], "invalid int value"),
    (["frobnicate"], "invalid choice"),
    (["start"], "required"),
    (["start", "tiny", "--set", "noequals"], "expected KEY=VALUE"),
    (["start", "tiny", "--set", "train.bogus=1"], "train.bogus: unknown setting"),
    (["start", "tiny", "--steps", "-3"], "train.steps=-3"),
    (["start", "nope"], "unknown preset 'nope'"),
    (["start", "tiny", "--tp", "3"], "not divisible by parallel.tp=3"),
    (["start", "tiny", "--name", "../../etc"], "name"),
    (["start", "tiny", "--pp", "2", "--set", "parallel.zero_stage=3"], "ZeRO-2/3"),
    (["start", "tiny", "--set", "train.global_batch_size=7"], "global_batch_size=7"),
])
def test_bad_input_is_one_message_and_exit_2(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--addr", "127.0.0.1:1", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    assert err.startswith("ds3dctl")
    assert "Traceback" not in err


def test_unreachable_daemon_is_exit_3(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--addr", "127.0.0.1:1", "--timeout", "2", "list"])
    assert e.value.code == 3
    assert "cannot reach ds3dd at 127.0.0.1:1" in capsys.readouterr().err


def test_cli_imports_no_torch_or_deepspeed():
    code = ("import sys, ds3d.daemon.cli; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("argv, needle", [
    (["--timeout", "nan", "list"], "--timeout: 'nan' is not a number of seconds above 0"),
    (["--timeout", "-1", "list"], "'-1' is not a number of seconds above 0"),
    (["--timeout", "inf", "list"], "'inf' is not a number of seconds above 0"),
    (["--addr", "127.0.0.1:99999", "list"], "'127.0.0.1:99999' is not HOST:PORT (port 1-65535)"),
    (["--addr", "", "list"], "'' is not HOST:PORT"),
    (["--addr", "unix:", "list"], "'unix:' is not HOST:PORT"),
    (["--addr", "127.0.0.1:1", "--token-file", "/dev/zero", "list"], "not a regular file"),
])
def test_odd_connection_arguments_are_usage_errors(argv, needle, capsys):
    """Was: --timeout nan/-1/inf an instant DEADLINE_EXCEEDED (exit 1, as if the daemon were
    slow), port 99999 dialled as 34463, an empty address grpc's INTERNAL, and --token-file
    /dev/zero a MemoryError traceback."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err, err


def test_a_token_that_cannot_be_sent_is_a_usage_error(monkeypatch, tmp_path, capsys):
    """Was: a newline inside DS3D_TOKEN was grpc's 'INTERNAL: Invalid metadata' (exit 1)."""
    monkeypatch.setenv("DS3D_TOKEN", "abc\ndef")
    with pytest.raises(SystemExit) as e:
        cli.main(["--addr", "127.0.0.1:1", "list"])
    assert e.value.code == 2 and "the token of DS3D_TOKEN has spaces, control" in \
        capsys.readouterr().err
    big = tmp_path / "token"
    big.write_text("x" * 5000)
    with pytest.raises(SystemExit) as e:
        cli.main(["--addr", "127.0.0.1:1", "--token-file", str(big), "list"])
    assert e.value.code == 2 and "5000 bytes; a token file holds the token only" in \
        capsys.readouterr().err


def test_addresses_and_timeouts_that_are_fine(monkeypatch):
    for addr in ("127.0.0.1:7531", "[::1]:7531", "unix:/run/ds3d.sock", "node-2.example:1"):
        assert parse("--addr", addr, "list").addr == addr
    assert parse("--timeout", "0.5", "list").timeout == 0.5


@pytest.mark.parametrize("argv, needle", [
    (["logs", "j", "--lines", "3000000000"], "--lines: '3000000000' is not a whole number"),
    (["logs", "j", "--lines", "-5"], "from 1 to 2147483647"),
    (["events", "j", "--step-every", "3000000000"], "--step-every: '3000000000'"),
    (["inject", "j", "nan", "--rank", "99999999999"], "--rank: '99999999999'"),
    (["rollback", "j", "99999999999999999999"], "from 0 to 9223372036854775807"),
    (["rollback", "j", "-1"], "step: '-1' is not a whole number"),
    (["inject", "j", "nan", "--rank", "0", "--at-step", "99999999999999999999"], "--at-step"),
    (["export", "j", "--step", "-1", "--out", "/tmp/x"], "--step: '-1'"),
])
def test_numbers_beyond_their_proto_field_are_usage_errors(argv, needle, capsys):
    """Was: 'ValueError: Value out of range' tracebacks from the request's int32/int64 field,
    before anything was sent."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--addr", "127.0.0.1:1", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err, err
