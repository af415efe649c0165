"""Regenerate ``keel_pb2*.py`` from ``keel.proto``.

Run from anywhere: ``python -m protos.generate [OUT_ROOT]``. The modules are written to
``OUT_ROOT/protos/`` (default: the repository root), so that the generated gRPC module
imports ``from protos import keel_pb2``.
"""

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent


def generate(out_root: Path = ROOT) -> None:
    (out_root / "protos").mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "protoc",
            f"-I{ROOT}",
            f"-I{include}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            "protos/keel.proto",
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
