"""Regenerates tandem_pb2.py and tandem_pb2_grpc.py from proto/tandem.proto."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto" / "tandem.proto"
OUT = Path(__file__).resolve().parent


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    rc = protoc.main(
        [
            "protoc",
            f"-I{PROTO.parent}",
            f"--python_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO),
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {rc})")
    grpc_file = out_dir / "tandem_pb2_grpc.py"
    # protoc writes a top-level import; ours live inside the router.api package.
    text = grpc_file.read_text().replace(
        "import tandem_pb2 as", "from router.api import tandem_pb2 as"
    )
    grpc_file.write_text(text)
    return [out_dir / "tandem_pb2.py", grpc_file]


def generated_texts() -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        return {p.name: p.read_text() for p in generate(Path(tmp))}


if __name__ == "__main__":
    for name, text in generated_texts().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}", file=sys.stderr)
