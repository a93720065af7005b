"""ds3dd's numeric flags are checked before anything starts: a value gRPC, the HTTP server or
the detectors would misread (a negative or NaN timeout, a port beyond 65535, a request limit of
0 or beyond a C int) is exit code 2 naming the flag and what it takes, not a traceback or a
daemon that starts and then refuses everything."""

import pytest

from ds3d.daemon import main as ds3dd_main


@pytest.mark.parametrize("flag,bad,needle", [
    ("--metrics-port", "99999", "is not a TCP port from 0 to 65535"),
    ("--metrics-port", "-1", "is not a TCP port from 0 to 65535"),
    ("--max-request-bytes", "0", "is not a whole number of bytes from 1024 to 2147483647"),
    ("--max-request-bytes", "-5", "is not a whole number of bytes from 1024"),
    ("--max-request-bytes", "99999999999", "is not a whole number of bytes from 1024"),
    ("--hang-timeout", "nan", "is not a number of seconds above 0"),
    ("--hang-timeout", "-5", "is not a number of seconds above 0"),
    ("--hang-timeout", "0", "is not a number of seconds above 0"),
    ("--drain-timeout", "-1", "is not 0 or a number of seconds above 0"),
    ("--drain-timeout", "inf", "is not 0 or a number of seconds above 0"),
    ("--drain-timeout", "nan", "is not 0 or a number of seconds above 0"),
])
def test_a_bad_value_is_refused_naming_the_flag(tmp_path, capsys, flag, bad, needle):
    with pytest.raises(SystemExit) as exc:
        ds3dd_main.main(["--state-dir", str(tmp_path / "state"), flag, bad])
    assert exc.value.code == 2
    assert f"{flag}: {bad!r} {needle}" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


def test_good_values_and_defaults():
    parse = ds3dd_main.build_parser().parse_args
    args = parse([])
    assert (args.metrics_port, args.max_request_bytes, args.hang_timeout,
            args.drain_timeout) == (None, 1 << 20, 120.0, 300.0)
    assert parse(["--metrics-port", "0"]).metrics_port == 0  # a free one (docs/metrics.md)
    args = parse(["--metrics-port", "9400", "--max-request-bytes", "1024",
                  "--hang-timeout", "0.5", "--drain-timeout", "0"])
    assert (args.metrics_port, args.max_request_bytes, args.hang_timeout,
            args.drain_timeout) == (9400, 1024, 0.5, 0.0)
