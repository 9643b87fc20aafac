#!/usr/bin/env python3
"""Generate the Python gRPC stubs of the worker service into ``agent/_proto/``.

    .venv/bin/python packaging/gen_proto.py [--force]

Runs grpc_tools.protoc (the grpcio-tools pinned in pyproject.toml, so the stubs match the
grpcio/protobuf runtime) on ``protocol/worker.proto``, writes ``worker_pb2.py``,
``worker_pb2_grpc.py`` (+ ``worker_pb2.pyi``) and an ``__init__.py``, and rewrites protoc's
top-level ``import worker_pb2`` into a package-relative import. Skips the work when every output
is newer than the proto and this script. Outputs appear atomically (generated in a temporary
directory, then renamed), so a reader never sees a half-written package.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "protocol"
OUT_DIR = REPO_ROOT / "agent" / "_proto"


def protos(proto_dir: Path = PROTO_DIR) -> list[Path]:
    return sorted(proto_dir.glob("*.proto"))


def outputs(proto_files: list[Path]) -> list[str]:
    names = ["__init__.py"]
    for proto in proto_files:
        names += [f"{proto.stem}_pb2.py", f"{proto.stem}_pb2_grpc.py", f"{proto.stem}_pb2.pyi"]
    return names


INIT_TEXT = '''"""Generated protobuf / gRPC stubs for protocol/*.proto (baton.worker.v1, baton.swarm.v1).

Made by packaging/gen_proto.py; do not edit, do not commit (ignored by git).
"""
'''


def up_to_date(out_dir: Path = OUT_DIR, proto_dir: Path = PROTO_DIR) -> bool:
    proto_files = protos(proto_dir)
    newest_input = max(p.stat().st_mtime_ns for p in [*proto_files, Path(__file__)])
    try:
        return all((out_dir / name).stat().st_mtime_ns > newest_input for name in outputs(proto_files))
    except FileNotFoundError:
        return False


def generate(out_dir: Path = OUT_DIR, proto_dir: Path = PROTO_DIR) -> None:
    from grpc_tools import protoc  # the venv's pinned grpcio-tools

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".proto.", dir=out_dir.parent) as tmp:
        staging = Path(tmp) / "stubs"
        staging.mkdir()
        # The include path of grpc_tools carries the well-known types (google/protobuf/*.proto).
        well_known = Path(protoc.__file__).parent / "_proto"
        proto_files = protos(proto_dir)
        args = [
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            f"-I{well_known}",
            f"--python_out={staging}",
            f"--pyi_out={staging}",
            f"--grpc_python_out={staging}",
            *map(str, proto_files),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"gen_proto: protoc failed on {', '.join(p.name for p in proto_files)}")
        for proto in proto_files:
            stem = proto.stem
            grpc_file = staging / f"{stem}_pb2_grpc.py"
            text = grpc_file.read_text()
            # protoc emits `import worker_pb2 as worker__pb2` in files with services, which only
            # works with the output directory on sys.path; inside agent._proto it must be relative.
            text = re.sub(rf"^import {stem}_pb2 as ", f"from . import {stem}_pb2 as ", text, flags=re.MULTILINE)
            grpc_file.write_text(text)
        (staging / "__init__.py").write_text(INIT_TEXT)
        missing = [name for name in outputs(proto_files) if not (staging / name).is_file()]
        if missing:
            raise SystemExit(f"gen_proto: protoc did not write {', '.join(missing)}")
        old = Path(tmp) / "old"
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(staging, out_dir)
        shutil.rmtree(old, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="regenerate even if up to date")
    args = parser.parse_args(argv)
    if not args.force and up_to_date():
        print(f"{OUT_DIR.relative_to(REPO_ROOT)} up to date")
        return 0
    generate()
    print(f"generated {OUT_DIR.relative_to(REPO_ROOT)} from {PROTO_DIR.relative_to(REPO_ROOT)}/*.proto")
    return 0


if __name__ == "__main__":
    sys.exit(main())
