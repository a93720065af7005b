"""DS3D_STARTUP_PROFILE: a worker's start profiled in parts, each written as pstats and text."""

from __future__ import annotations

import pstats
import time

from ds3d.trainer.startup_profile import ENV, StartupProfile


def _build() -> None:
    time.sleep(0.05)


def _first_step() -> None:
    sum(i * i for i in range(20000))
    import ds3d_startup_probe  # noqa: F401 - a module first imported in this part


def test_parts_are_written_apart_and_name_their_calls(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert StartupProfile.from_env(0, 0) is None  # off unless asked for
    (tmp_path / "ds3d_startup_probe.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(ENV, str(tmp_path / "prof"))
    profile = StartupProfile.from_env(rank=3, restart=2)
    assert profile is not None
    _build()
    profile.part("build_and_load")
    _first_step()
    profile.stop("first_step")
    profile.stop("again")  # stopped already: nothing more is written

    written = sorted(p.name for p in (tmp_path / "prof").iterdir())
    assert written == ["startup-rank3-restart2-build_and_load.prof",
                       "startup-rank3-restart2-build_and_load.txt",
                       "startup-rank3-restart2-first_step.prof",
                       "startup-rank3-restart2-first_step.txt"]
    build = pstats.Stats(str(tmp_path / "prof" / "startup-rank3-restart2-build_and_load.prof"))
    first = pstats.Stats(str(tmp_path / "prof" / "startup-rank3-restart2-first_step.prof"))
    names = {fn[2] for fn in build.stats}  # type: ignore[attr-defined]
    assert "_build" in names and "_first_step" not in names
    assert "_first_step" in {fn[2] for fn in first.stats}  # type: ignore[attr-defined]
    text = (tmp_path / "prof" / "startup-rank3-restart2-first_step.txt").read_text()
    assert "== by cumulative ==" in text and "== by tottime ==" in text and "_first_step" in text
    assert text.endswith("== modules first imported during this part (1) ==\n"
                         "ds3d_startup_probe\n")
    build_text = (tmp_path / "prof" / "startup-rank3-restart2-build_and_load.txt").read_text()
    assert "ds3d_startup_probe" not in build_text
