"""The generated stubs (odyssey_client/_pb, made at build time from proto/odyssey/v1/odyssey.proto)."""
try:
    from odyssey_client._pb import odyssey_pb2 as pb
    from odyssey_client._pb import odyssey_pb2_grpc as pb_grpc
except ImportError as e:  # pragma: no cover - only in a source tree nobody built
    raise ImportError(
        "odyssey_client's gRPC stubs are missing: install the package (pip install ./client/python) "
        "or generate them in the source tree (python client/python/_build_stubs.py)") from e

__all__ = ["pb", "pb_grpc"]
