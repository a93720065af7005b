"""Build hook: generate the gRPC/protobuf stubs from protos/**/*.proto before packaging.

Why a `build_py` subclass: both a normal install (wheel) and `pip install -e .` (PEP 660 editable
wheel) run `build_py`, so the stubs exist in either case without anyone running protoc by hand.
The stubs are written next to the .proto files (gitignored) so that an editable install imports
them from the source tree, and a normal build copies them into the wheel like any module. All
metadata stays in pyproject.toml.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_ROOT = ROOT / "protos"


def generate_stubs() -> list[Path]:
    """Runs protoc (from grpcio-tools, with the mypy-protobuf plugins) on every .proto under
    protos/; returns the .proto files compiled. Raises SystemExit on a protoc error."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(PROTO_ROOT.rglob("*.proto"))
    if not protos:
        return []
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = [
        "grpc_tools.protoc",
        *[f"--plugin={name}={_plugin(name)}"
          for name in ("protoc-gen-mypy", "protoc-gen-mypy_grpc")],
        f"--proto_path={PROTO_ROOT}",
        f"--proto_path={include}",
        f"--python_out={PROTO_ROOT}",
        f"--grpc_python_out={PROTO_ROOT}",
        f"--mypy_out={PROTO_ROOT}",
        f"--mypy_grpc_out={PROTO_ROOT}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit(f"protoc failed on {', '.join(map(str, protos))}")
    return protos


def _plugin(name: str) -> str:
    """mypy-protobuf's protoc plugins, found next to this interpreter first: a build started as
    `.venv/bin/pip` does not necessarily have the venv's bin/ on PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: install mypy-protobuf (a build requirement)")
    return found


class BuildPyWithProtos(build_py):
    """`build_py` that generates the stubs first, then packages them like hand-written modules."""

    def run(self) -> None:
        generate_stubs()
        # package data (the .pyi files) is computed lazily; drop any value cached before the
        # stubs existed so that they are included
        self.__dict__.pop("data_files", None)
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
