"""ds3dd.log is bounded: rotated by size with a fixed number of older files, the newest record
always in ds3dd.log, and bad rotation flags refused at start with the flag and its range."""

import json
import logging

import pytest
import structlog

from ds3d.daemon import main as ds3dd_main
from ds3d.daemon.logging import configure, get_logger


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    structlog.reset_defaults()


def test_the_log_is_rotated_and_bounded(tmp_path, restore_logging):
    log_file = tmp_path / "ds3dd.log"
    configure(log_file, "n1", console=False, max_bytes=4000, backups=2)
    log = get_logger("ds3d.test")
    for i in range(600):  # ~100 bytes each: 60 KB through a 3 x 4 KB budget
        log.info("soak line", i=i)
    files = sorted(tmp_path.glob("ds3dd.log*"))
    assert [f.name for f in files] == ["ds3dd.log", "ds3dd.log.1", "ds3dd.log.2"]
    assert all(f.stat().st_size <= 4000 for f in files)
    newest = [json.loads(line) for line in log_file.read_text().splitlines()]
    assert newest[-1]["i"] == 599 and newest[-1]["node"] == "n1"
    # the three files hold the newest records in order, none lost between them
    kept = [json.loads(line)["i"] for f in (files[2], files[1], files[0])
            for line in f.read_text().splitlines()]
    assert kept == list(range(kept[0], 600))


def test_a_second_daemon_refused_the_lock_never_opens_the_log(tmp_path, restore_logging):
    """The file is opened at the first record (delay): configuring alone creates nothing."""
    configure(tmp_path / "ds3dd.log", "n1", console=False)
    assert not (tmp_path / "ds3dd.log").exists()


@pytest.mark.parametrize("argv,needle", [
    (["--log-max-mb", "0"], "'0' is not a whole number of MiB from 1 to 1048576"),
    (["--log-max-mb", "1.5"], "'1.5' is not a whole number of MiB"),
    (["--log-backups", "0"], "'0' is not a whole number of files from 1 to 1000"),
    (["--log-backups", "many"], "'many' is not a whole number of files"),
    (["--log-level", "loud"], "invalid choice: 'loud'"),
])
def test_bad_rotation_flags_are_refused_before_anything_starts(tmp_path, capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        ds3dd_main.main(["--state-dir", str(tmp_path / "state"), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and needle in err
    assert not (tmp_path / "state").exists()


def test_rotation_flags_reach_the_parser_with_their_defaults():
    args = ds3dd_main.build_parser().parse_args([])
    assert (args.log_max_mb, args.log_backups) == (100, 5)
    args = ds3dd_main.build_parser().parse_args(["--log-max-mb", "7", "--log-backups", "3"])
    assert (args.log_max_mb, args.log_backups) == (7, 3)
