"""Worker commands: the stored form (Job.command_action, in existing state directories and in
the `command` events) and the command file the workers read are spelled in one place
(daemon/commands.py); both forms must stay what they were."""

import json
from pathlib import Path

import pytest

from ds3d.daemon.commands import Action, Command
from ds3d.daemon.jobdir import JobDir
from ds3d.trainer.loop import ACTIONS as TRAINER_ACTIONS

FORMS = [
    ("save", Command(Action.SAVE), {"action": "save"}),
    ("pause", Command(Action.PAUSE), {"action": "pause"}),
    ("pause_fast", Command(Action.PAUSE, fast=True), {"action": "pause", "fast": True}),
    ("stop", Command(Action.STOP), {"action": "stop"}),
    ("stop_now", Command(Action.STOP_NOW), {"action": "stop_now"}),
    ("profile", Command(Action.PROFILE), {"action": "profile"}),
    ("repartition:0,6,10", Command.repartition([0, 6, 10]),
     {"action": "repartition", "boundaries": [0, 6, 10]}),
    ("restart", Command(Action.RESTART), {"action": "restart"}),
]


@pytest.mark.parametrize("stored,command,fields", FORMS, ids=[f[0] for f in FORMS])
def test_each_command_has_its_stored_form_and_file_fields(tmp_path, stored, command, fields):
    assert command.encode() == stored
    assert Command.decode(stored) == command
    jobdir = JobDir(tmp_path, "j")
    jobdir.control.mkdir(parents=True)
    jobdir.write_command(7, command)
    written = json.loads(jobdir.command_file.read_text())
    assert list(written)[:3] == ["id", "action", "time"]
    assert {k: v for k, v in written.items() if k not in ("id", "time")} == fields
    assert written["id"] == 7


def test_nothing_pending_is_the_empty_form():
    assert Command.decode("") is None


@pytest.mark.parametrize("stored", ["pause_slow", "save:1,2", "repartition", "repartition:a",
                                    "restart_fast"])
def test_a_form_ds3d_never_writes_is_refused(stored):
    with pytest.raises(ValueError):
        Command.decode(stored)


def test_fast_and_boundaries_only_where_they_mean_something():
    with pytest.raises(ValueError, match="only a pause can be fast"):
        Command(Action.STOP, fast=True)
    with pytest.raises(ValueError, match="stage boundaries"):
        Command(Action.SAVE, boundaries=(0, 3))
    with pytest.raises(ValueError, match="stage boundaries"):
        Command(Action.REPARTITION)


def test_the_trainer_knows_every_action_and_no_other():
    """A command the workers do not know is ignored by them (CommandInbox.poll): the two
    lists must name the same actions."""
    assert set(TRAINER_ACTIONS) == {a.value for a in Action}


@pytest.mark.parametrize("text", ['[1, 2]', '7', 'null', '{"id": "3", "action": "pause"}',
                                  '{"id": true, "action": "pause"}', '{"id": 3, "action": 5}',
                                  '\xff\xfe not text'])
def test_a_damaged_command_file_reads_as_no_command(tmp_path: Path, text: str) -> None:
    """Rank 0 reads control/command.json at every step: a file damaged by hand reads as no
    command (raised, it would end rank 0 at every step and the group with it); the next good
    command is taken."""
    from ds3d.trainer.loop import CommandInbox

    (tmp_path / "control").mkdir()
    path = tmp_path / "control" / "command.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape") if text.isascii() else
                     text.encode("latin-1"))
    inbox = CommandInbox(tmp_path)
    assert inbox.poll() == (0, 0)
    path.write_text(json.dumps({"id": 4, "action": "pause"}))
    assert inbox.poll() == (4, TRAINER_ACTIONS["pause"])
