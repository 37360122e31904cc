"""odyssey_client: Python client of the odyssey training backend.

ServiceClient connects to an odyssey-controller; create_training_client() (create_session())
starts an RL session, a TrainingClient, whose methods (forward_backward, optim_step, forward,
save_checkpoint, load_checkpoint, export_weights, sample, compute_logprobs, push_rollouts) return
futures that may also be awaited, with `*_async` twins, and execute in issue order; its
create_sampling_client() gives a SamplingClient (sample, compute_logprobs). The split follows
Tinker's API (README.md). Datum builds batches from token lists or numpy arrays.

The generated protobuf modules are `odyssey_client.pb` and `odyssey_client.pb_grpc` for
callers who need the raw API.
"""
from odyssey_client._proto import pb, pb_grpc
from odyssey_client.client import AwaitableFuture, SamplingClient, ServiceClient, Session, TrainingClient
from odyssey_client.errors import JobFailedError, OdysseyError, SessionTimeoutError
from odyssey_client.types import (LOSS_KINDS, AdamW, CheckpointResult, Datum, ForwardBackwardResult, ForwardResult,
                                  JobInfo, Loss, OptimStepResult, RolloutResult, SampledSequence, SampleResponse,
                                  SamplingParams, batch_to_proto)

__version__ = "0.1.0"

__all__ = [
    "ServiceClient", "TrainingClient", "SamplingClient", "Session", "AwaitableFuture", "SamplingParams",
    "SampleResponse", "SampledSequence", "Datum", "Loss", "AdamW", "LOSS_KINDS", "batch_to_proto",
    "ForwardBackwardResult", "ForwardResult", "OptimStepResult", "CheckpointResult", "RolloutResult", "JobInfo",
    "OdysseyError", "JobFailedError", "SessionTimeoutError", "pb", "pb_grpc",
]
