"""Exceptions of odyssey_client. Every failed call raises OdysseyError (or a subclass) carrying
the gRPC status code and the server's message, which names the field and the rule that failed."""
from __future__ import annotations

from typing import Optional

import grpc


class OdysseyError(Exception):
    """A call failed. `code` is the grpc.StatusCode, `message` the server's text, `method` the
    RPC ("ForwardBackward", ...) and `job` the job it was about, when there was one."""

    def __init__(self, code: grpc.StatusCode, message: str, method: str = "", job: str = ""):
        self.code = code
        self.message = message
        self.method = method
        self.job = job
        where = " ".join(p for p in (method, job) if p)
        super().__init__(f"{where + ': ' if where else ''}{code.name}: {message}")

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError, method: str = "", job: str = "") -> "OdysseyError":
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        return cls(code if code is not None else grpc.StatusCode.UNKNOWN, details or "", method, job)


class JobFailedError(OdysseyError):
    """The session's job ended (FAILED, CANCELLED or SUCCEEDED) while waiting for it to run;
    `state` is its state name and `message` the job's error."""

    def __init__(self, job: str, state: str, error: str):
        self.state = state
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, f"job is {state}: {error or '(no error given)'}",
                         "create_session", job)


class SessionTimeoutError(OdysseyError):
    """The session's job was not RUNNING within the timeout (still PENDING: no idle worker)."""

    def __init__(self, job: str, state: str, timeout: Optional[float]):
        self.state = state
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED,
                         f"job still {state} after {timeout}s (no idle worker for it?)", "create_session", job)
