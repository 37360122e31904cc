"""Build hooks of odyssey-client: the gRPC stubs are generated from proto/odyssey/v1/odyssey.proto
(the repository's ../../proto, or the copy an sdist carries) into odyssey_client/_pb at build
time, never committed. The metadata lives in pyproject.toml."""
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _build_stubs  # noqa: E402  (a sibling file, not part of the package)


class BuildPyWithStubs(build_py):
    """build_py that also generates odyssey_client/_pb (into the build tree; into the source
    tree for an editable install, which imports from there)."""

    def run(self):
        super().run()
        editable = getattr(self, "editable_mode", False)
        target = os.path.join(HERE, "odyssey_client") if editable else os.path.join(self.build_lib, "odyssey_client")
        _build_stubs.generate(target)


class SdistWithProto(sdist):
    """sdist that carries the proto (./proto/odyssey/v1/odyssey.proto), so the sdist builds on its own."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        dst = os.path.join(base_dir, "proto", os.path.dirname(_build_stubs.PROTO_FILE))
        os.makedirs(dst, exist_ok=True)
        shutil.copy(os.path.join(_build_stubs.find_proto_root(), _build_stubs.PROTO_FILE), dst)


def _dependencies():
    """grpcio and protobuf no older than the generated code checks for at import time (read off
    a generation into a scratch directory, so the floors match the grpcio-tools doing the build)."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as tmp:
            need = _build_stubs.generate(tmp)
    except ImportError:  # a metadata-only query without grpcio-tools
        need = {"grpcio": "1.51.0", "protobuf": "4.21.0"}
    return [f"grpcio>={need['grpcio']}", f"protobuf>={need['protobuf']}"]


setup(
    packages=["odyssey_client"],
    package_data={"odyssey_client": ["py.typed"]},
    install_requires=_dependencies(),
    cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProto},
)
