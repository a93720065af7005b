"""A worker's node memory files (/dev/shm/ds3d-ID/rank-N.arena, .held) go when nothing will
read them: at a clean end and at a refusal (EXIT_CONFIG, never restarted). Was: a refusal mid-run
(a token id outside the vocabulary) under plain torchrun left them in /dev/shm. Any other error
keeps them: the restart restores from them."""

import pytest

from ds3d.trainer.errors import ConfigError
from ds3d.trainer.worker import _run_to_end

pytestmark = pytest.mark.timeout(30)


class FakeTrainer:
    def __init__(self, error: BaseException | None) -> None:
        self.error, self.calls = error, []
        self.ckpt = self

    def run(self) -> int:
        if self.error is not None:
            raise self.error
        return 10

    def wait_for_store(self, step: int) -> None:
        self.calls.append("durable")

    def release_node_memory(self) -> None:
        self.calls.append("released")

    def close(self) -> None:
        self.calls.append("closed")


@pytest.mark.parametrize(("error", "calls"), [
    (None, ["durable", "released", "closed"]),
    (ConfigError("token id 300 in /data/x is outside model.vocab_size=256"),
     ["released", "closed"]),
    (RuntimeError("NCCL timeout"), ["closed"]),  # restarted: the restore reads them
])
def test_node_memory_is_released_when_no_restart_reads_it(error, calls):
    trainer = FakeTrainer(error)
    if error is None:
        _run_to_end(trainer)
    else:
        with pytest.raises(type(error)):
            _run_to_end(trainer)
    assert trainer.calls == calls
