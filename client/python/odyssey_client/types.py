"""Plain Python values of the TrainingService: batches (Datum), loss and optimizer settings, and
the results of each call. Everything converts to and from the generated protos here, so the rest
of the client (and its users) never touch protobuf.

Token arrays are Python sequences or numpy arrays (anything with `tolist()`); results carry
Python lists, with `.numpy()` helpers for callers who want arrays.

Shift convention (engine/rl_loss.h): a Datum's `target_tokens[i]` is the token position i
predicts, so for a sequence x of length n, tokens = x[:-1] and target_tokens = x[1:], and every
per-token array has n - 1 entries, aligned with the targets.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

from odyssey_client._proto import pb

LOSS_KINDS = ("cross_entropy", "importance_sampling", "ppo")

ArrayLike = Union[Sequence[int], Sequence[float], Any]  # lists, tuples, numpy arrays


def _as_list(values: Optional[ArrayLike]) -> list:
    if values is None:
        return []
    if hasattr(values, "tolist"):  # numpy arrays and scalars, torch tensors
        out = values.tolist()
        return out if isinstance(out, list) else [out]
    return list(values)


def _ints(name: str, values: Optional[ArrayLike]) -> List[int]:
    out = _as_list(values)
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                out[i] = int(v)
            else:
                raise TypeError(f"{name}[{i}] ({v!r}) must be an integer token id")
    return out


def _floats(values: Optional[ArrayLike]) -> List[float]:
    return [float(v) for v in _as_list(values)]


@dataclass
class Datum:
    """One sequence of a batch.

    tokens: the model's input ids (S of them). target_tokens: the id each position predicts (S).
    weights: loss weight per token (0 = not in the loss, e.g. the prompt); None = all 1.
    sampler_logprobs: the inference engine's logprob of each target token (S); needed by
    importance_sampling and ppo, and gives the trainer-vs-sampler mismatch.
    advantages: per-token advantage (S); needed by importance_sampling and ppo.

    Build one from a whole sequence with `Datum.from_sequence`, or from a prompt and a sampled
    completion with `Datum.from_completion`. `validate()` checks the lengths; the server checks
    everything else (id range, finite values, sizes) and names what is wrong.
    """

    tokens: ArrayLike
    target_tokens: ArrayLike
    weights: Optional[ArrayLike] = None
    sampler_logprobs: Optional[ArrayLike] = None
    advantages: Optional[ArrayLike] = None

    @classmethod
    def from_sequence(cls, sequence: ArrayLike, weights: Optional[ArrayLike] = None) -> "Datum":
        """A datum predicting each token of `sequence` from the ones before it (cross-entropy
        style): tokens = sequence[:-1], target_tokens = sequence[1:]. `weights`, when given, has
        one entry per target (len(sequence) - 1)."""
        seq = _ints("sequence", sequence)
        if len(seq) < 2:
            raise ValueError(f"sequence has {len(seq)} token(s): a datum needs at least 2 (an input and its target)")
        d = cls(tokens=seq[:-1], target_tokens=seq[1:], weights=None if weights is None else _floats(weights))
        d.validate()
        return d

    @classmethod
    def from_completion(cls, prompt: ArrayLike, completion: ArrayLike,
                        sampler_logprobs: Optional[ArrayLike] = None,
                        advantage: Optional[Union[float, ArrayLike]] = None) -> "Datum":
        """A datum for a completion sampled after a prompt (RL).

        The sequence prompt + completion is shifted (tokens = all but the last, targets = all but
        the first), so the last prompt position predicts the first completion token. Only the
        completion's targets are in the loss: weights are 0 on the len(prompt) - 1 prompt targets
        and 1 on the len(completion) completion targets.

        sampler_logprobs: one per completion token (the sampler's logprob of it), or None.
        advantage: a number (the same for every completion token, e.g. a sequence reward minus a
        baseline), one per completion token, or None. Prompt positions get 0 for both.
        """
        p = _ints("prompt", prompt)
        c = _ints("completion", completion)
        if not p:
            raise ValueError("prompt is empty: the first completion token needs a position to predict it from")
        if not c:
            raise ValueError("completion is empty: nothing to train on")
        pad = len(p) - 1
        seq = p + c
        d = cls(tokens=seq[:-1], target_tokens=seq[1:], weights=[0.0] * pad + [1.0] * len(c))
        if sampler_logprobs is not None:
            q = _floats(sampler_logprobs)
            if len(q) != len(c):
                raise ValueError(f"sampler_logprobs has {len(q)} entries, completion {len(c)}: one per completion token")
            d.sampler_logprobs = [0.0] * pad + q
        if advantage is not None:
            if isinstance(advantage, (int, float)) or (hasattr(advantage, "ndim") and advantage.ndim == 0):
                a = [float(advantage)] * len(c)
            else:
                a = _floats(advantage)
                if len(a) != len(c):
                    raise ValueError(f"advantage has {len(a)} entries, completion {len(c)}: one per completion token "
                                     "(or one number)")
            d.advantages = [0.0] * pad + a
        return d

    def __len__(self) -> int:
        return len(_as_list(self.tokens))

    def validate(self) -> None:
        """Raises ValueError when a per-token array's length differs from the tokens'."""
        n = len(_as_list(self.tokens))
        if n == 0:
            raise ValueError("tokens is empty")
        for name in ("target_tokens", "weights", "sampler_logprobs", "advantages"):
            v = getattr(self, name)
            if v is None and name != "target_tokens":
                continue
            m = len(_as_list(v))
            if m != n:
                raise ValueError(f"{name} has {m} entries, tokens {n}: per-token arrays have one entry per token")

    def to_proto(self) -> "pb.Datum":
        """The wire form. Absent arrays (None) are sent empty, which the server reads as absent."""
        return pb.Datum(tokens=_ints("tokens", self.tokens), target_tokens=_ints("target_tokens", self.target_tokens),
                        weights=_floats(self.weights), sampler_logprobs=_floats(self.sampler_logprobs),
                        advantages=_floats(self.advantages))

    @classmethod
    def from_proto(cls, d: "pb.Datum") -> "Datum":
        return cls(tokens=list(d.tokens), target_tokens=list(d.target_tokens),
                   weights=list(d.weights) or None, sampler_logprobs=list(d.sampler_logprobs) or None,
                   advantages=list(d.advantages) or None)


BatchLike = Sequence[Union[Datum, "pb.Datum"]]


def batch_to_proto(batch: BatchLike, check: bool = True) -> List["pb.Datum"]:
    """Converts a batch (Datum or pb.Datum entries). With `check`, Datum lengths are validated
    here so the mistake surfaces before a sequence number is spent on a doomed call."""
    if isinstance(batch, (Datum, pb.Datum)):
        raise TypeError("batch must be a sequence of Datum, not a single Datum")
    out = []
    for i, d in enumerate(batch):
        if isinstance(d, pb.Datum):
            out.append(d)
        elif isinstance(d, Datum):
            if check:
                try:
                    d.validate()
                except ValueError as e:
                    raise ValueError(f"batch[{i}]: {e}") from None
            out.append(d.to_proto())
        else:
            raise TypeError(f"batch[{i}] is a {type(d).__name__}: want odyssey_client.Datum")
    return out


@dataclass
class Loss:
    """The loss of a ForwardBackward (engine/rl_loss.h has the math).

    kind: "cross_entropy" | "importance_sampling" | "ppo".
    clip_low, clip_high: PPO's clip range [1 - clip_low, 1 + clip_high] of the importance ratio;
    None = the server's default (0.2).
    """

    kind: str = "cross_entropy"
    clip_low: Optional[float] = None
    clip_high: Optional[float] = None

    def to_proto(self) -> "pb.LossConfig":
        return pb.LossConfig(kind=self.kind, clip_low=self.clip_low or 0.0, clip_high=self.clip_high or 0.0)

    @classmethod
    def of(cls, loss: Union[str, "Loss", dict, None]) -> "Loss":
        if loss is None:
            return cls()
        if isinstance(loss, Loss):
            return loss
        if isinstance(loss, str):
            return cls(kind=loss)
        if isinstance(loss, dict):
            return cls(**loss)
        raise TypeError(f"loss must be a kind name, a Loss or a dict, not {type(loss).__name__}")


@dataclass
class AdamW:
    """AdamW settings of one OptimStep. The server checks the ranges (lr > 0, betas in [0, 1),
    eps >= 0, weight_decay >= 0) and names what is wrong."""

    lr: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0

    def to_proto(self) -> "pb.AdamWParams":
        return pb.AdamWParams(lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps,
                              weight_decay=self.weight_decay)

    @classmethod
    def of(cls, adam: Union["AdamW", dict, float]) -> "AdamW":
        if isinstance(adam, AdamW):
            return adam
        if isinstance(adam, dict):
            return cls(**adam)
        if isinstance(adam, (int, float)) and not isinstance(adam, bool):
            return cls(lr=float(adam))
        raise TypeError(f"adam must be an AdamW, a dict or a learning rate, not {type(adam).__name__}")


def _logprobs(msgs) -> List[List[float]]:
    return [list(m.values) for m in msgs]


def _phases(msgs) -> Dict[str, float]:
    return {m.phase: m.seconds for m in msgs}  # the worker sends them longest first


@dataclass
class ForwardBackwardResult:
    """What a ForwardBackward returns. logprobs: per datum, the trainer's logprob of each target
    token before this call's update. loss: normalized by weight_sum. mismatch_*: trainer vs
    sampler |logp - q| over weighted tokens of datums with sampler logprobs (mismatch_tokens of
    them). clipped_tokens: PPO tokens whose gradient the clip removed. tokens: positions run.
    seconds: compute time on the worker. phases: with the session's phase_times, seconds of each
    kind of phase of the call on the worker ("layer # backward", "loss", the kernels' phases; a
    phase includes the phases inside it), longest first; else empty."""

    logprobs: List[List[float]]
    loss: float
    weight_sum: float
    mismatch_mean: float
    mismatch_max: float
    mismatch_tokens: int
    clipped_tokens: int
    tokens: int
    seconds: float
    phases: Dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, r: "pb.ForwardBackwardResponse") -> "ForwardBackwardResult":
        return cls(logprobs=_logprobs(r.logprobs), loss=r.loss, weight_sum=r.weight_sum, mismatch_mean=r.mismatch_mean,
                   mismatch_max=r.mismatch_max, mismatch_tokens=r.mismatch_tokens, clipped_tokens=r.clipped_tokens,
                   tokens=r.tokens, seconds=r.seconds, phases=_phases(r.phases))

    def numpy(self) -> list:
        """logprobs as a list of float32 numpy arrays (one per datum)."""
        import numpy as np

        return [np.asarray(v, dtype=np.float32) for v in self.logprobs]


@dataclass
class ForwardResult:
    """What a Forward returns: per datum, the logprob of each target token."""

    logprobs: List[List[float]]

    @classmethod
    def from_proto(cls, r: "pb.ForwardResponse") -> "ForwardResult":
        return cls(logprobs=_logprobs(r.logprobs))

    def numpy(self) -> list:
        import numpy as np

        return [np.asarray(v, dtype=np.float32) for v in self.logprobs]


@dataclass
class OptimStepResult:
    """step: optimizer steps completed, this one included; grad_norm: before clipping; lr: applied.
    phases: with the session's phase_times, the step's phase times (as ForwardBackwardResult's)."""

    step: int
    grad_norm: float
    lr: float
    phases: Dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, r: "pb.OptimStepResponse") -> "OptimStepResult":
        return cls(step=r.step, grad_norm=r.grad_norm, lr=r.lr, phases=_phases(r.phases))


@dataclass
class CheckpointResult:
    """directory: where the checkpoint (weights + optimizer state) is; step: the step it holds."""

    directory: str
    step: int


@dataclass
class RolloutResult:
    """One PushRollouts batch: its ForwardBackward and the OptimStep after it."""

    forward_backward: ForwardBackwardResult
    optim_step: OptimStepResult

    @classmethod
    def from_proto(cls, r: "pb.RolloutResult") -> "RolloutResult":
        return cls(forward_backward=ForwardBackwardResult.from_proto(r.forward_backward),
                   optim_step=OptimStepResult.from_proto(r.optim_step))


@dataclass
class JobInfo:
    """A job as the controller reports it (the fields a client usually reads; `proto` has all)."""

    name: str
    state: str
    kind: str
    step: int
    loss: float
    error: str
    last_checkpoint: str
    workers: List[str] = field(default_factory=list)
    proto: Any = field(default=None, repr=False)

    @classmethod
    def from_proto(cls, j: "pb.Job") -> "JobInfo":
        return cls(name=j.name, state=pb.Job.State.Name(j.state), kind=pb.JobKind.Name(j.spec.kind), step=j.step,
                   loss=j.loss, error=j.error, last_checkpoint=j.last_checkpoint, workers=list(j.workers), proto=j)

    @property
    def done(self) -> bool:
        return self.state in ("SUCCEEDED", "FAILED", "CANCELLED")


@dataclass
class SamplingParams:
    """The sampling parameters of TrainingService.Sample (Tinker's SamplingParams, `stop` as token
    ids). max_tokens: new tokens per sequence (>= 1); temperature: >= 0, 0 = greedy; top_p in
    (0, 1] (1 = off); top_k >= 0 (0 = off); stop: token ids that end a sequence (emitted, then the
    sequence stops); seed: None = the worker draws one (SampleResponse.seed says which). Every
    rule is checked by the worker and comes back as the call's OdysseyError naming the field."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: Sequence[int] = ()
    seed: Optional[int] = None

    @classmethod
    def of(cls, value: "Union[SamplingParams, dict, None]") -> "SamplingParams":
        if value is None:
            return cls()
        if isinstance(value, SamplingParams):
            return value
        if isinstance(value, dict):
            return cls(**value)
        raise TypeError(f"sampling_params must be a SamplingParams or a dict, not {type(value).__name__}")

    def to_proto(self) -> "pb.SamplingParams":
        p = pb.SamplingParams(max_tokens=int(self.max_tokens), temperature=float(self.temperature),
                              top_p=float(self.top_p), top_k=int(self.top_k), stop_tokens=[int(t) for t in self.stop])
        if self.seed is not None:
            p.seed = int(self.seed)
        return p


@dataclass
class SampledSequence:
    """One sampled continuation: its new tokens (the stop token included when one ended it), the
    model's logprob of each (temperature 1, before top-k / top-p: the sampler logprobs the RL
    losses take), why it ended ("stop" | "length") and the prompt it continues."""

    tokens: List[int]
    logprobs: List[float]
    stop_reason: str
    prompt_index: int = 0


@dataclass
class SampleResponse:
    """What a Sample returns: prompts x num_samples sequences, prompt-major (prompt i's sample j
    at i * num_samples + j), the seed used, the new tokens in all and the worker's compute time."""

    sequences: List[SampledSequence]
    seed: int = 0
    tokens: int = 0
    seconds: float = 0.0

    @classmethod
    def from_proto(cls, r: "pb.SampleResponse") -> "SampleResponse":
        return cls(sequences=[SampledSequence(list(s.tokens), list(s.logprobs), s.stop_reason, s.prompt_index)
                              for s in r.sequences], seed=r.seed, tokens=r.tokens, seconds=r.seconds)
