"""Client-side copies of the controller's edge checks (server/validation.cc) for TrainingService
requests.

Why: the controller checks a request's shape (loss kind, clip range, AdamW ranges,
directories, batch size) *before* it takes the request's place in the job's `sequence` order, so
a sequenced call it refuses there never uses its number, and every later call of the session
would wait for it (then fail ABORTED). The Session runs these checks before stamping a number
and raises ValueError at once instead. Per-token rules (id range, finite values, lengths) are
checked after ordering, by the worker, and come back as the call's OdysseyError.
"""
from __future__ import annotations

import math
from typing import Optional

MAX_BATCH_DATUMS = 65536
MAX_PATH_BYTES = 4096
MAX_PATH_COMPONENT_BYTES = 200  # server/validation.h kMaxPathComponentBytes
DTYPES = ("", "float32", "bfloat16")
LOSS_KINDS = ("cross_entropy", "importance_sampling", "ppo")


def check_loss(kind: str, clip_low: Optional[float], clip_high: Optional[float], field: str = "loss") -> None:
    if kind not in LOSS_KINDS:
        raise ValueError(f"{field}.kind ({kind!r}) must be one of {', '.join(LOSS_KINDS)}")
    lo = clip_low or 0.0
    hi = clip_high or 0.0
    if lo != 0 and not (0 < lo < 1):
        raise ValueError(f"{field}.clip_low ({lo}) must be in (0, 1) (None = 0.2)")
    if hi != 0 and not (0 < hi <= 1e6):
        raise ValueError(f"{field}.clip_high ({hi}) must be in (0, 1e6] (None = 0.2)")


def check_adam(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, field: str = "adam") -> None:
    if not (0 < lr <= 10):  # the controller's bound (server/validation.h kMaxLearningRate)
        raise ValueError(f"{field}.lr ({lr}) must be in (0, 10]")
    if not (0 <= beta1 < 1):
        raise ValueError(f"{field}.beta1 ({beta1}) must be in [0, 1)")
    if not (0 <= beta2 < 1):
        raise ValueError(f"{field}.beta2 ({beta2}) must be in [0, 1)")
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"{field}.eps ({eps}) must be >= 0 and finite")
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise ValueError(f"{field}.weight_decay ({weight_decay}) must be >= 0 and finite")


def check_directory(directory: Optional[str], required: bool, field: str = "directory") -> None:
    if not directory:
        if required:
            raise ValueError(f"{field} is required (an absolute path on the session's worker)")
        return
    if len(directory.encode()) > MAX_PATH_BYTES:
        raise ValueError(f"{field} length ({len(directory.encode())} bytes) must be <= {MAX_PATH_BYTES}")
    if "\0" in directory:
        raise ValueError(f"{field} must not contain NUL bytes")
    if not directory.startswith("/"):
        raise ValueError(f"{field} ({directory!r}) must be an absolute path on the session's worker")
    for part in directory.split("/"):
        if len(part.encode()) > MAX_PATH_COMPONENT_BYTES:
            raise ValueError(f"{field}: a path component of {len(part.encode())} bytes must be <= "
                             f"{MAX_PATH_COMPONENT_BYTES} bytes")


def check_dtype(dtype: Optional[str]) -> None:
    if (dtype or "") not in DTYPES:
        raise ValueError(f"dtype ({dtype!r}) must be None, 'float32' or 'bfloat16'")


def check_batch(batch, max_positions: Optional[int], field: str = "batch") -> None:
    """`batch`: a list of pb.Datum. max_positions: the session's seq_len x batch_size, if known."""
    if not batch:
        raise ValueError(f"{field} is empty; at least one datum is required")
    if len(batch) > MAX_BATCH_DATUMS:
        raise ValueError(f"{field} has {len(batch)} datums; at most {MAX_BATCH_DATUMS} per call")
    if max_positions:
        positions = sum(len(d.tokens) for d in batch)
        if positions > max_positions:
            raise ValueError(f"{field}: {positions} token positions exceed the session's limit of {max_positions} "
                             "(seq_len x batch_size); split the batch")


def check_prompts(prompts, field: str = "prompts") -> None:
    """`prompts`: a list of pb.SamplePrompt (the controller's edge check of Sample)."""
    if not prompts:
        raise ValueError(f"{field} is empty; at least one prompt is required")
    if len(prompts) > MAX_BATCH_DATUMS:
        raise ValueError(f"{field} has {len(prompts)} prompts; at most {MAX_BATCH_DATUMS} per call")
