"""A configuration the workers refuse is not a crash (issue 17 item 8): which errors count as a
refusal (ds3d's own, DeepSpeed's config errors), the error file `@record` writes, and how the
agent turns torch elastic's ProcessFailures (reading those error files) into its exit code and
message. No processes: the error files are written by torch's own ErrorHandler."""

from __future__ import annotations

import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure

from ds3d.checkpoints.errors import RestoreError
from ds3d.checkpoints.reshape import ConversionError
from ds3d.daemon.agent import failure_result
from ds3d.daemon.detectors import EXIT_CONFIG as DETECTOR_EXIT_CONFIG
from ds3d.trainer.errors import ConfigError, StorageError, TransientStorageError
from ds3d.trainer.exit_codes import EXIT_CONFIG
from ds3d.trainer.worker import config_refusal, main


def test_the_exit_code_has_one_home():
    from ds3d.daemon import agent

    assert EXIT_CONFIG == 2
    assert agent.EXIT_CONFIG is EXIT_CONFIG and DETECTOR_EXIT_CONFIG is EXIT_CONFIG


def test_deepspeed_refusing_its_config_is_a_refusal():
    from deepspeed.runtime.config import DeepSpeedConfigError
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as bad_key:  # DeepSpeed forbids unknown keys here
        DeepSpeedZeroConfig(**{"stage": 1, "no_such_key": True})
    assert config_refusal(bad_key.value)
    assert config_refusal(DeepSpeedConfigError("train_batch_size is not equal to ..."))
    assert config_refusal(ConfigError("data.source holds fewer than one sample"))
    assert config_refusal(StorageError("checkpoint store refused"))  # ds3d's own refusals
    assert not config_refusal(RuntimeError("gloo: connection reset by peer"))
    assert not config_refusal(ValueError("buffer size must be a multiple of element size"))
    # ds3d's errors it marks retryable are not refusals: the group is restarted
    assert not config_refusal(TransientStorageError("store unreachable"))
    assert not config_refusal(ConversionError("ds_to_universal failed", True))
    assert not config_refusal(RestoreError("rank 1's node cannot get checkpoint step 8"))


def _failure(tmp_path, rank: int, exitcode: int, error: BaseException | None) -> ProcessFailure:
    path = tmp_path / f"error-{rank}.json"
    if error is not None:
        import os

        os.environ["TORCHELASTIC_ERROR_FILE"] = str(path)
        try:
            try:
                raise error
            except BaseException as e:  # noqa: BLE001 - recorded as the worker's @record would
                ErrorHandler().record_exception(e)
        finally:
            del os.environ["TORCHELASTIC_ERROR_FILE"]
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                          error_file=str(path))


def test_agent_passes_a_refusal_on_with_the_message_from_the_error_file(tmp_path):
    failures = {0: _failure(tmp_path, 0, EXIT_CONFIG,
                            ConfigError("train.steps: DeepSpeed refused key 'bogus'")),
                1: _failure(tmp_path, 1, -15, None)}  # ended by the agent
    code, error = failure_result(failures)
    assert code == EXIT_CONFIG
    assert error == "ConfigError: train.steps: DeepSpeed refused key 'bogus'"


def test_agent_reports_a_crash_with_the_first_workers_error(tmp_path):
    failures = {1: _failure(tmp_path, 1, 1, ValueError("odd bytes")),
                0: _failure(tmp_path, 0, -9, None)}
    code, error = failure_result(failures)
    assert code == 1
    assert "exit codes by rank {0: -9, 1: 1}" in error and "ValueError: odd bytes" in error
    # a refusal mixed with a real crash is a crash: restarting may help the crashed rank
    mixed = {0: _failure(tmp_path, 0, EXIT_CONFIG, ConfigError("x")),
             1: _failure(tmp_path, 1, 1, ValueError("y"))}
    assert failure_result(mixed)[0] == 1


def test_worker_refusal_writes_the_error_file_and_exits_with_the_config_code(tmp_path,
                                                                             monkeypatch):
    """main() under @record with a configuration ds3d refuses (an unknown preset): exit code
    EXIT_CONFIG, and the torch elastic error file names the refusal."""
    err = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(err))
    for var, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(var, value)
    code = main(["--run-dir", str(tmp_path / "run"), "--config", "no-such-preset"])
    assert code == EXIT_CONFIG
    message = json.loads(err.read_text())["message"]["message"]
    assert message.startswith("ConfigError: ") and "no-such-preset" in message, message
