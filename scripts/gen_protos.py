"""Generate the Python gRPC code for every .proto under protos/ into gen/ (or another folder).

`make proto` runs this; `tests/test_generated_code.py` runs it into a temporary folder and fails
when the committed code in gen/ has drifted from protos/.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import grpc_tools
from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto; return the files written."""
    out.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTOS.rglob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Every folder on the way is a regular package, so `import gpuplane.governor.v1` works.
    for folder in {p.parent for p in out.rglob("*_pb2.py")}:
        while folder != out:
            (folder / "__init__.py").touch()
            folder = folder.parent
    return sorted(p for p in out.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "gen")
    args = parser.parse_args(argv)
    files = generate(args.out)
    print(f"generated {len(files)} files under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
