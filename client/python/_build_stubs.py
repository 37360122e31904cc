"""Generates the gRPC stubs of odyssey_client from proto/odyssey/v1/odyssey.proto.

Used by setup.py at build/install time (the stubs are never committed) and by the tests that
use the package from the source tree. Run by hand for development:

    python client/python/_build_stubs.py            # writes client/python/odyssey_client/_pb/

The generated modules land in `odyssey_client/_pb/` as `odyssey_pb2.py`, `odyssey_pb2_grpc.py`
(and `.pyi` type stubs); protoc's absolute import `from odyssey.v1 import odyssey_pb2` is
rewritten to the package-relative one, so no top-level `odyssey` package is installed. The
descriptor keeps its proto path ("odyssey/v1/odyssey.proto"), so these stubs can live in one
process next to other copies generated from the same file.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_FILE = "odyssey/v1/odyssey.proto"


def find_proto_root() -> str:
    """The directory holding odyssey/v1/odyssey.proto: $ODYSSEY_PROTO_DIR, the repository's
    proto/ (../../proto from here), or the copy an sdist carries (./proto)."""
    candidates = []
    if os.environ.get("ODYSSEY_PROTO_DIR"):
        candidates.append(os.environ["ODYSSEY_PROTO_DIR"])
    candidates += [os.path.join(HERE, "..", "..", "proto"), os.path.join(HERE, "proto")]
    for c in candidates:
        if os.path.isfile(os.path.join(c, PROTO_FILE)):
            return os.path.abspath(c)
    raise FileNotFoundError(f"{PROTO_FILE} not found under any of {candidates} (set ODYSSEY_PROTO_DIR)")


def generate(package_dir: str) -> dict:
    """Writes the stubs into `package_dir`/_pb (package_dir is an `odyssey_client` directory).

    Returns the minimum runtime versions the generated code needs:
    {"protobuf": "X.Y.Z", "grpcio": "X.Y.Z"}.
    """
    import grpc_tools
    from grpc_tools import protoc

    proto_root = find_proto_root()
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    out = os.path.join(package_dir, "_pb")
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(["grpc_tools.protoc", f"-I{proto_root}", f"-I{well_known}", f"--python_out={tmp}",
                          f"--grpc_python_out={tmp}", f"--pyi_out={tmp}", os.path.join(proto_root, PROTO_FILE)])
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed ({rc}) on {os.path.join(proto_root, PROTO_FILE)}")
        gen = os.path.join(tmp, "odyssey", "v1")
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.makedirs(out)
        for name in ("odyssey_pb2.py", "odyssey_pb2.pyi", "odyssey_pb2_grpc.py"):
            with open(os.path.join(gen, name)) as f:
                text = f.read()
            text = re.sub(r"^from odyssey\.v1 import odyssey_pb2 as", "from odyssey_client._pb import odyssey_pb2 as",
                          text, flags=re.M)
            with open(os.path.join(out, name), "w") as f:
                f.write(text)
    with open(os.path.join(out, "__init__.py"), "w") as f:
        f.write('"""Generated from proto/odyssey/v1/odyssey.proto by _build_stubs.py; do not edit."""\n')
    return required_runtime(out)


def required_runtime(pb_dir: str) -> dict:
    """The protobuf and grpcio versions the generated code in `pb_dir` checks for at import."""
    with open(os.path.join(pb_dir, "odyssey_pb2.py")) as f:
        m = re.search(r"Protobuf Python Version: (\d+\.\d+\.\d+)", f.read())
    with open(os.path.join(pb_dir, "odyssey_pb2_grpc.py")) as f:
        g = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", f.read())
    return {"protobuf": m.group(1) if m else "4.21.0", "grpcio": g.group(1) if g else "1.51.0"}


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "odyssey_client")
    print(generate(target))
