"""Generate the Python stubs for proto/tito/v1 into tito/v1 (or into --out for freshness checks).

The stubs are committed; CI regenerates them into a temporary directory and fails if they
differ, so nobody edits generated code by hand and nobody forgets to regenerate.

Only proto/tito/v1 is compiled. proto/google/rpc holds vendored copies of google.rpc's status,
code and error details for clients in other languages; Python gets those from the
googleapis-common-protos package (google.rpc.*_pb2), so no stubs are generated for them here.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PACKAGE_DIR = Path("tito") / "v1"
HEADER_INIT = '"""Generated gRPC stubs for the tito.v1 contract. Do not edit: run scripts/gen_protos.py."""\n'


def generate(out_root: Path) -> Path:
    """Run protoc for every .proto under proto/tito/v1 (never the vendored proto/google), writing
    into out_root/tito/v1."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    well_known = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    out_dir = out_root / PACKAGE_DIR
    (out_dir / "__init__.py").write_text(HEADER_INIT)
    return out_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed stubs are stale")
    args = parser.parse_args()
    if not args.check:
        target = ROOT / PACKAGE_DIR
        for old in target.glob("*_pb2*.py*"):
            old.unlink()
        with tempfile.TemporaryDirectory() as tmp:
            fresh = generate(Path(tmp))
            target.mkdir(parents=True, exist_ok=True)
            for f in fresh.iterdir():
                shutil.copy2(f, target / f.name)
        print(f"wrote stubs to {target.relative_to(ROOT)}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        committed = ROOT / PACKAGE_DIR
        names = {p.name for p in fresh.iterdir()} | {p.name for p in committed.glob("*_pb2*.py*")} | {"__init__.py"}
        stale = [n for n in sorted(names) if not (committed / n).exists() or not (fresh / n).exists()
                 or not filecmp.cmp(fresh / n, committed / n, shallow=False)]
    if stale:
        print("stale generated stubs (run: python scripts/gen_protos.py):", ", ".join(stale))
        return 1
    print("generated stubs are fresh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
