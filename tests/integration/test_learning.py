"""The tiny model learns real text (byte-level tokens of a public-domain text shipped in
trainer/assets)."""


import pytest

from ds3d.trainer.data import encode_text

from support import REPO, losses, torchrun


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiny_loss_falls_on_real_text(tmp_path):
    data = tmp_path / "text.bin"
    n = encode_text(REPO / "trainer" / "assets" / "public_domain.txt", data)
    assert n > 5000
    torchrun(tmp_path / "run", 2, sets=[f"data.source={str(data)!r}".replace("'", '"'),
                                        "train.steps=60", "parallel.pp=2"])
    got = losses(tmp_path / "run")
    first, last = sum(got[s] for s in range(1, 6)) / 5, sum(got[s] for s in range(56, 61)) / 5
    assert first > 5.0  # ~ln(256): untrained
    assert last < first - 2.0, (first, last)  # learned the bytes' statistics and more
