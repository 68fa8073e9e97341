"""Generate the Python stubs of proto/specd/v1 into specd/v1 (`python -m specd.protogen [OUT]`).

The stubs are committed; tests/test_protos.py regenerates them into a temporary folder and fails
when the committed ones differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "specd" / "v1").glob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    out_dir.mkdir(parents=True, exist_ok=True)
    code = protoc.main(["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out_dir}",
                        f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos])
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    generated = sorted((out_dir / "specd" / "v1").glob("*_pb2*.py*"))
    (out_dir / "specd" / "v1" / "__init__.py").write_text('"""Generated gRPC stubs (specd.protogen)."""\n')
    return generated


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT
    for path in generate(out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
