"""odyssey_client: Python client of the odyssey training backend.

TrainingClient connects to an odyssey-controller; create_session() starts an RL session whose
methods (forward_backward, optim_step, forward, save_checkpoint, load_checkpoint,
export_weights, push_rollouts) return concurrent.futures.Future objects and execute in issue
order. Datum builds batches from token lists or numpy arrays. See README.md.

The generated protobuf modules are `odyssey_client.pb` and `odyssey_client.pb_grpc` for
callers who need the raw API.
"""
from odyssey_client._proto import pb, pb_grpc
from odyssey_client.client import Session, TrainingClient
from odyssey_client.errors import JobFailedError, OdysseyError, SessionTimeoutError
from odyssey_client.types import (LOSS_KINDS, AdamW, CheckpointResult, Datum, ForwardBackwardResult, ForwardResult,
                                  JobInfo, Loss, OptimStepResult, RolloutResult, batch_to_proto)

__version__ = "0.1.0"

__all__ = [
    "TrainingClient", "Session", "Datum", "Loss", "AdamW", "LOSS_KINDS", "batch_to_proto",
    "ForwardBackwardResult", "ForwardResult", "OptimStepResult", "CheckpointResult", "RolloutResult", "JobInfo",
    "OdysseyError", "JobFailedError", "SessionTimeoutError", "pb", "pb_grpc",
]
