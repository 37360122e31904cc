"""ServiceClient, TrainingClient and SamplingClient: the Python face of odyssey's JobService and
TrainingService, split as Tinker's API is (README.md has the side-by-side table).

    service = ServiceClient("127.0.0.1:50051")
    with service.create_training_client(base_model="tiny", seq_len=64, batch_size=8) as tc:
        fb = tc.forward_backward(batch, loss="ppo")     # a Future, returned at once
        st = tc.optim_step(lr=1e-3)                     # pipelined behind it
        print(fb.result().loss, st.result().step)
        sampler = tc.create_sampling_client()          # samples the session's current weights
        seqs = sampler.sample([1, 2, 3], num_samples=4, sampling_params=SamplingParams(max_tokens=8))

asyncio: every returned future is also awaitable (`r = await tc.optim_step(lr=1e-3)`), and each
call has an `*_async` twin (`fut = await tc.optim_step_async(...)`; then `await fut`): the call
is issued (and takes its place in the order) when the coroutine runs, its result awaited later.

Ordering: every TrainingService call of a TrainingClient (and of its SamplingClients) is stamped with `sequence` 1, 2, 3, ... in the
order the methods are called (under a lock, so threads may share one), and the controller
runs call n only after call n-1: pipelined calls execute in issue order however gRPC delivers
them. push_rollouts (whose stream carries no sequence) waits for the calls issued before it and
holds back the ones issued after it until its stream ends.

Thread safety: the clients may be used from several threads. Result futures are
concurrent.futures.Future (AwaitableFuture); their callbacks run on gRPC's threads, so keep them
short. `Session` is TrainingClient's former name, kept as an alias.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import grpc

from odyssey_client import _checks
from odyssey_client._proto import pb, pb_grpc
from odyssey_client.errors import JobFailedError, OdysseyError, SessionTimeoutError
from odyssey_client.types import (AdamW, BatchLike, CheckpointResult, Datum, ForwardBackwardResult, ForwardResult,
                                  JobInfo, Loss, OptimStepResult, RolloutResult, SampleResponse, SamplingParams,
                                  batch_to_proto)

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # the controller's default --max-message-bytes
JOB_CALL_RETRIES = 3  # UNAVAILABLE retries of JobService calls (0.25 + 0.5 + 1 s of backoff)


def _pem(value: Optional[Union[str, bytes]]) -> Optional[bytes]:
    """PEM bytes from a path or bytes (None stays None)."""
    if value is None or isinstance(value, bytes):
        return value
    with open(value, "rb") as f:
        return f.read()


class AwaitableFuture(concurrent.futures.Future):
    """A concurrent.futures.Future that asyncio code may also await: `await fut` gives
    fut.result() (or raises its exception) without blocking the event loop."""

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


def _job_name(name_or_id: Union[str, int]) -> str:
    s = str(name_or_id)
    return s if s.startswith("jobs/") else f"jobs/{s}"


class ServiceClient:
    """A connection to an odyssey-controller (Tinker's ServiceClient): creates TrainingClients
    (RL sessions) and SamplingClients, lists and cancels jobs. Formerly named TrainingClient.

    target: "host:port". token: sent as `authorization: Bearer <token>` on every call.
    tls_ca: PEM file (path or bytes) of the CA that signed the controller's certificate; turns on
    TLS. tls_server_name: the name to check the certificate against when it differs from the
    host in `target` (e.g. connecting by IP). tls_cert + tls_key: a client certificate and its
    key (PEM paths or bytes) for a controller that requires mutual TLS. timeout: deadline in
    seconds of the JobService calls (create/get/list/cancel). call_timeout: default deadline of
    TrainingService calls, counted from the moment a call is issued (so it includes the time it
    waits behind earlier pipelined calls); None = no deadline. max_message_bytes: the largest
    message sent or received (replies carry one logprob per token of a batch).
    """

    def __init__(self, target: str, token: Optional[str] = None, tls_ca: Optional[Union[str, bytes]] = None,
                 tls_server_name: Optional[str] = None, *, tls_cert: Optional[Union[str, bytes]] = None,
                 tls_key: Optional[Union[str, bytes]] = None, timeout: float = 30.0,
                 call_timeout: Optional[float] = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.target = target
        self.timeout = timeout
        self.call_timeout = call_timeout
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together (a client certificate for mutual TLS)")
        if tls_ca is not None:
            if tls_server_name:
                options.append(("grpc.ssl_target_name_override", tls_server_name))
            creds = grpc.ssl_channel_credentials(root_certificates=_pem(tls_ca), private_key=_pem(tls_key),
                                                 certificate_chain=_pem(tls_cert))
            self._channel = grpc.secure_channel(target, creds, options)
        else:
            if tls_server_name or tls_cert:
                raise ValueError("tls_server_name and tls_cert need tls_ca (TLS is off without a CA)")
            self._channel = grpc.insecure_channel(target, options)
        self._metadata: Tuple[Tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.jobs = pb_grpc.JobServiceStub(self._channel)
        self.training = pb_grpc.TrainingServiceStub(self._channel)
        self.planner = pb_grpc.PlannerServiceStub(self._channel)

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def metadata(self) -> Tuple[Tuple[str, str], ...]:
        return self._metadata

    def _call(self, method: str, fn, request, job: str = "", timeout: Optional[float] = None):
        """One JobService call. UNAVAILABLE (controller restarting, connection reset) is retried
        up to JOB_CALL_RETRIES times with backoff: every JobService call is safe to repeat
        (CreateJob carries a request id, so a retry returns the job the first attempt made).
        TrainingService calls are never retried here: they are not idempotent."""
        delay = 0.25
        for attempt in range(JOB_CALL_RETRIES + 1):
            try:
                return fn(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == JOB_CALL_RETRIES:
                    raise OdysseyError.from_rpc_error(e, method, job) from None
            time.sleep(delay)
            delay *= 2

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- jobs -------------------------------------------------------------------------------
    def get_job(self, name: Union[str, int]) -> JobInfo:
        """The job `name` ("jobs/7" or 7)."""
        name = _job_name(name)
        return JobInfo.from_proto(self._call("GetJob", self.jobs.GetJob, pb.GetJobRequest(name=name), name))

    def list_jobs(self, state: Optional[str] = None, page_size: int = 0, limit: Optional[int] = None) -> List[JobInfo]:
        """Jobs, oldest first, optionally only those in `state` ("RUNNING", ...); follows the pages
        until `limit` jobs (None = all)."""
        out: List[JobInfo] = []
        token = ""
        state_value = pb.Job.State.Value(state) if state else pb.Job.STATE_UNSPECIFIED
        while True:
            r = self._call("ListJobs", self.jobs.ListJobs,
                           pb.ListJobsRequest(page_size=page_size, page_token=token, state=state_value))
            out.extend(JobInfo.from_proto(j) for j in r.jobs)
            token = r.next_page_token
            if not token or (limit is not None and len(out) >= limit):
                return out if limit is None else out[:limit]

    def job_events(self, name: Union[str, int], page_size: int = 0) -> List["pb.JobEvent"]:
        """Every event the controller recorded for job `name` (state changes, each step's
        StepMetrics, checkpoints, messages), oldest first, following ListJobEvents' pages."""
        name = _job_name(name)
        out: List[pb.JobEvent] = []
        token = ""
        while True:
            r = self._call("ListJobEvents", self.jobs.ListJobEvents,
                           pb.ListJobEventsRequest(name=name, page_size=page_size, page_token=token), name)
            out.extend(r.events)
            token = r.next_page_token
            if not token:
                return out

    def cancel(self, name: Union[str, int]) -> JobInfo:
        """Cancels job `name` (an RL session ends CANCELLED and frees its worker)."""
        name = _job_name(name)
        return JobInfo.from_proto(self._call("CancelJob", self.jobs.CancelJob, pb.CancelJobRequest(name=name), name))

    def create_session(self, model: str = "tiny", *, seq_len: int = 256, batch_size: int = 8,
                       idle_timeout_seconds: int = 0, dtype: str = "", attention: str = "", world_size: int = 0,
                       indexer_stage: str = "", recompute: str = "", recompute_every_k: int = 0, offload: str = "", mlp_tile_tokens: int = 0,
                       loss_tile_tokens: int = 0, host_budget_bytes: int = 0, device_resident: Optional[int] = None,
                       attention_head_groups: int = 0, keep_attention: Optional[bool] = None,
                       optimizer_on_host: Optional[bool] = None, keep_selection: Optional[bool] = None,
                       bf16_moments: Optional[bool] = None,
                       grad_clip: float = 0.0, phase_times: bool = False,
                       seed: int = 0, display_name: str = "",
                       checkpoint_directory: str = "", priority: int = 0, lora_rank: int = 0,
                       lora_alpha: float = 0.0, lora_target_modules: Sequence[str] = (), lora_merge: bool = False,
                       request_id: Optional[str] = None,
                       wait: bool = True, wait_timeout: Optional[float] = 300.0) -> "TrainingClient":
        """Creates an RL session (a job of kind RL_SESSION) and, with `wait`, waits until it is
        RUNNING on a worker.

        model: a named shape ("tiny": byte-level, for CPU) or a Hugging Face checkpoint directory
        the workers can read; dtype: "" (auto), "float32", "bfloat16". indexer_stage: hybrid
        models with DSA layers, "dense_warmup" or "sparse" in place of the stage the model's
        config.json names ("" = its own; a warm-up checkpoint trains sparse with "sparse").
        seq_len x batch_size is the
        largest batch, in token positions, one forward_backward/forward may carry (the memory the
        controller's planner checks). idle_timeout_seconds: the session ends SUCCEEDED after this
        long without calls (0 = the server's default, an hour). recompute/offload/tiles/
        host_budget_bytes/device_resident/attention_head_groups/keep_attention/optimizer_on_host/
        keep_selection/bf16_moments:
        the fields of JobSpec.memory ("" / 0 / None = the planner's choice).
        grad_clip: gradient-norm clipping of every optim_step (<= 0: none; each optim_step carries
        its own AdamW settings). seed: model initialization of named shapes. world_size: workers
        the session runs on, data parallel (0 = 1); the controller splits each batch between them
        by datums, so seq_len x batch_size then bounds each worker's share and a batch may hold
        world_size times as many positions.
        lora_rank > 0: LoRA (JobSpec.lora): adapters of this rank (lora_alpha: 0 = rank) on
        lora_target_modules (empty: all seven projections) train on the frozen base; checkpoints
        hold the adapters, export_weights writes a PEFT adapter folder (or, with lora_merge, merged
        weights).
        phase_times: every forward_backward and optim_step is timed phase by phase on the worker
        (JobSpec.profile.phase_times) and its result's `phases` holds the times.
        request_id: idempotency key (a retry with the same id returns the same job); a random one
        by default. Raises JobFailedError when the job fails to start, SessionTimeoutError when it
        is not RUNNING after wait_timeout seconds.
        """
        spec = _session_spec(model, seq_len=seq_len, batch_size=batch_size, idle_timeout_seconds=idle_timeout_seconds,
                             dtype=dtype, attention=attention, world_size=world_size, indexer_stage=indexer_stage,
                             recompute=recompute,
                             recompute_every_k=recompute_every_k, offload=offload, mlp_tile_tokens=mlp_tile_tokens,
                             loss_tile_tokens=loss_tile_tokens, host_budget_bytes=host_budget_bytes,
                             device_resident=device_resident, attention_head_groups=attention_head_groups,
                             keep_attention=keep_attention, optimizer_on_host=optimizer_on_host,
                             keep_selection=keep_selection, bf16_moments=bf16_moments, phase_times=phase_times,
                             grad_clip=grad_clip, seed=seed, display_name=display_name,
                             checkpoint_directory=checkpoint_directory, priority=priority, lora_rank=lora_rank,
                             lora_alpha=lora_alpha, lora_target_modules=lora_target_modules, lora_merge=lora_merge)
        request = pb.CreateJobRequest(spec=spec, request_id=request_id or uuid.uuid4().hex)
        job = self._call("CreateJob", self.jobs.CreateJob, request)
        session = TrainingClient(self, job.name, max_positions=seq_len * max(1, batch_size))
        if wait:
            session.wait_running(wait_timeout)
        return session

    def plan_session(self, model: str = "tiny", *, seq_len: int = 256, batch_size: int = 8, dtype: str = "",
                     indexer_stage: str = "", recompute: str = "", recompute_every_k: int = 0, offload: str = "", mlp_tile_tokens: int = 0,
                     loss_tile_tokens: int = 0, host_budget_bytes: int = 0, device_resident: Optional[int] = None,
                     attention_head_groups: int = 0, keep_attention: Optional[bool] = None,
                     optimizer_on_host: Optional[bool] = None, keep_selection: Optional[bool] = None,
                       bf16_moments: Optional[bool] = None,
                     gpu_bytes: int = 0, host_bytes: int = 0,
                     max_seq_len: bool = False, lora_rank: int = 0, lora_alpha: float = 0.0,
                     lora_target_modules: Sequence[str] = ()) -> "pb.PlanResponse":
        """What create_session with these arguments would need per GPU rank, from the
        controller's planner, creating nothing (PlannerService.Plan; server/README.md): `fits`,
        `message` (why not), the strategy (`memory`, `device_resident`, `attention_head_groups`,
        `optimizer_on_host`), `gpu_peak_bytes` with its `terms`, `host_bytes`, the machine planned
        for (`hardware`, `planned_gpu_bytes`, `planned_host_bytes`: the attached workers' largest
        GPU unless gpu_bytes / host_bytes say otherwise) and, with max_seq_len, the longest
        sequence that fits."""
        spec = _session_spec(model, seq_len=seq_len, batch_size=batch_size, dtype=dtype, indexer_stage=indexer_stage,
                             recompute=recompute,
                             recompute_every_k=recompute_every_k, offload=offload, mlp_tile_tokens=mlp_tile_tokens,
                             loss_tile_tokens=loss_tile_tokens, host_budget_bytes=host_budget_bytes,
                             device_resident=device_resident, attention_head_groups=attention_head_groups,
                             keep_attention=keep_attention, optimizer_on_host=optimizer_on_host,
                             keep_selection=keep_selection, bf16_moments=bf16_moments,
                             lora_rank=lora_rank, lora_alpha=lora_alpha, lora_target_modules=lora_target_modules)
        return self._call("Plan", self.planner.Plan, pb.PlanRequest(spec=spec, gpu_bytes=gpu_bytes,
                                                                    host_bytes=host_bytes, max_seq_len=max_seq_len))

    def create_training_client(self, base_model: str = "tiny", **kwargs) -> "TrainingClient":
        """Tinker's name for create_session: `base_model` is create_session's `model`; the other
        keyword arguments are create_session's."""
        return self.create_session(base_model, **kwargs)

    def create_lora_training_client(self, base_model: str = "tiny", rank: int = 32, **kwargs) -> "TrainingClient":
        """Tinker's name for a LoRA session: create_session(base_model, lora_rank=rank, ...); the
        other keyword arguments are create_session's (lora_alpha, lora_target_modules, ...)."""
        return self.create_session(base_model, lora_rank=rank, **kwargs)

    async def create_lora_training_client_async(self, base_model: str = "tiny", rank: int = 32,
                                                **kwargs) -> "TrainingClient":
        return await asyncio.to_thread(self.create_session, base_model, lora_rank=rank, **kwargs)

    async def create_session_async(self, model: str = "tiny", **kwargs) -> "TrainingClient":
        """create_session without blocking the event loop (it runs on a thread: creating a
        session waits until a worker runs it)."""
        return await asyncio.to_thread(self.create_session, model, **kwargs)

    async def create_training_client_async(self, base_model: str = "tiny", **kwargs) -> "TrainingClient":
        return await asyncio.to_thread(self.create_session, base_model, **kwargs)

    def create_sampling_client(self, session: Union[str, int, "TrainingClient"]) -> "SamplingClient":
        """A SamplingClient of an RL session: a TrainingClient's (its calls then share that
        client's order), or a job name, whose client sends its calls unsequenced (each runs when
        it arrives, after the calls the controller received before it)."""
        if isinstance(session, TrainingClient):
            return SamplingClient(session)
        return SamplingClient(self.session(session, sequenced=False))

    def session(self, name: Union[str, int], sequenced: bool = True, first_sequence: int = 1) -> "TrainingClient":
        """A TrainingClient for an existing RL session job (e.g. one created by another process).

        sequenced: stamp calls with `sequence`, starting at first_sequence (the job's next
        expected number); False sends sequence 0 (unordered: each call runs when it arrives),
        the safe choice when other clients may also be calling the job."""
        name = _job_name(name)
        spec = self.get_job(name).proto.spec
        return TrainingClient(self, name, sequenced=sequenced, first_sequence=first_sequence,
                              max_positions=spec.data.seq_len * max(1, spec.data.batch_size))


def _session_spec(model: str, *, seq_len: int, batch_size: int, idle_timeout_seconds: int = 0, dtype: str = "",
                  attention: str = "", world_size: int = 0, indexer_stage: str = "", recompute: str = "",
                  recompute_every_k: int = 0,
                  offload: str = "", mlp_tile_tokens: int = 0, loss_tile_tokens: int = 0, host_budget_bytes: int = 0,
                  device_resident: Optional[int] = None, attention_head_groups: int = 0,
                  keep_attention: Optional[bool] = None, optimizer_on_host: Optional[bool] = None,
                  keep_selection: Optional[bool] = None,
                  bf16_moments: Optional[bool] = None, phase_times: bool = False,
                  grad_clip: float = 0.0, seed: int = 0, display_name: str = "", checkpoint_directory: str = "",
                  priority: int = 0, lora_rank: int = 0, lora_alpha: float = 0.0,
                  lora_target_modules: Sequence[str] = (), lora_merge: bool = False) -> "pb.JobSpec":
    """The JobSpec of an RL session (create_session's and plan_session's arguments)."""
    memory = pb.MemorySpec(recompute=recompute, recompute_every_k=recompute_every_k, offload=offload,
                           mlp_tile_tokens=mlp_tile_tokens, loss_tile_tokens=loss_tile_tokens,
                           host_budget_bytes=host_budget_bytes, attention_head_groups=attention_head_groups)
    # Optional fields: None leaves them unset (the planner's choice), a value sets them.
    if device_resident is not None:
        memory.device_resident = device_resident
    if keep_attention is not None:
        memory.keep_attention = keep_attention
    if optimizer_on_host is not None:
        memory.optimizer_on_host = optimizer_on_host
    if keep_selection is not None:
        memory.keep_selection = keep_selection
    if bf16_moments is not None:
        memory.bf16_moments = bf16_moments
    return pb.JobSpec(
        kind=pb.RL_SESSION, display_name=display_name, priority=priority,
        model=pb.ModelSpec(name=model, dtype=dtype, attention=attention, indexer_stage=indexer_stage),
        parallel=pb.ParallelSpec(world_size=world_size),
        memory=memory,
        optimizer=pb.OptimizerSpec(grad_clip=grad_clip),
        data=pb.DataSpec(seq_len=seq_len, batch_size=batch_size, seed=seed),
        checkpoint=pb.CheckpointSpec(directory=checkpoint_directory),
        rl=pb.RlSessionSpec(idle_timeout_seconds=idle_timeout_seconds),
        profile=pb.ProfileSpec(phase_times=phase_times),
        lora=pb.LoraSpec(rank=lora_rank, alpha=lora_alpha, target_modules=list(lora_target_modules), merge=lora_merge))


LossLike = Union[str, Loss, dict, None]
AdamLike = Union[AdamW, dict, float]


class TrainingClient:
    """An RL session (Tinker's TrainingClient; formerly named Session, an alias kept): a job
    holding a model and its optimizer on a worker, driven call by call.

    Every method returns an AwaitableFuture at once; `.result()` (or `await`) gives the dataclass
    or raises OdysseyError (code + the server's message). Calls execute in the order they were
    made (see the module docstring). Use as a context manager to cancel the job on exit.
    """

    def __init__(self, client: ServiceClient, name: str, sequenced: bool = True, first_sequence: int = 1,
                 max_positions: Optional[int] = None):
        self.client = client
        self.name = name
        self.sequenced = sequenced
        self.max_positions = max_positions  # seq_len x batch_size: the most token positions per call
        # Re-entrant: a call that fails at once runs its done-callbacks (which untrack it) on the
        # issuing thread, inside _issue's critical section.
        self._lock = threading.RLock()
        self._next_sequence = first_sequence
        self._issued = 0
        self._pending: "set[concurrent.futures.Future]" = set()
        self._failures: List[concurrent.futures.Future] = []  # failed since the last wait_all
        self._gate: Optional[concurrent.futures.Future] = None  # an unfinished push_rollouts

    def __repr__(self) -> str:
        return f"TrainingClient({self.name!r})"

    def __enter__(self) -> "TrainingClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- lifecycle --------------------------------------------------------------------------
    def info(self) -> JobInfo:
        """The session's job as the controller reports it now."""
        return self.client.get_job(self.name)

    def wait_running(self, timeout: Optional[float] = 300.0) -> JobInfo:
        """Blocks until the job is RUNNING. Raises JobFailedError if it ended instead (with the
        job's error), SessionTimeoutError after `timeout` seconds (None = wait forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        while True:
            job = self.info()
            if job.state == "RUNNING":
                return job
            if job.done:
                raise JobFailedError(self.name, job.state, job.error)
            if deadline is not None and time.monotonic() >= deadline:
                raise SessionTimeoutError(self.name, job.state, timeout)
            time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)

    def cancel(self) -> JobInfo:
        """Cancels the job: the worker drops the model and optimizer (save a checkpoint first)."""
        return self.client.cancel(self.name)

    def close(self) -> None:
        """Waits for the calls in flight (their errors are left in their futures), then cancels
        the job unless it already ended."""
        self.wait_all(raise_errors=False)
        try:
            if not self.info().done:
                self.cancel()
        except OdysseyError:
            pass  # already gone (or the controller is): nothing left to free

    def wait_all(self, timeout: Optional[float] = None, raise_errors: bool = True) -> None:
        """Waits until every call issued so far has finished. With raise_errors, raises the error
        of the earliest-issued call that failed since the last wait_all (whether or not its
        future was looked at), so a pipeline can check many calls at once."""
        with self._lock:
            pending = list(self._pending)
        _, not_done = concurrent.futures.wait(pending, timeout=timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} call(s) of {self.name} still running after {timeout}s")
        with self._lock:
            failures, self._failures = self._failures, []
        if raise_errors and failures:
            raise min(failures, key=lambda f: f.issue_index).exception()

    # -- calls ------------------------------------------------------------------------------
    def _issue(self, method: str, send: Callable[[int, Optional[float]], "grpc.Future"],
               convert: Callable, timeout: Optional[float]) -> concurrent.futures.Future:
        """Stamps the next sequence number and sends the call (or queues it behind an unfinished
        push_rollouts); returns the Future of its converted result."""
        fut: concurrent.futures.Future = AwaitableFuture()
        fut.set_running_or_notify_cancel()  # running from the start: a sent call cannot be taken back
        timeout = self.client.call_timeout if timeout is None else timeout
        issued = time.monotonic()

        def finish(call: "grpc.Future") -> None:
            err = call.exception()
            if err is not None:
                fut.set_exception(OdysseyError.from_rpc_error(err, method, self.name)
                                  if isinstance(err, grpc.RpcError) else err)
                return
            try:
                fut.set_result(convert(call.result()))
            except Exception as e:  # a reply the client cannot read
                fut.set_exception(e)

        def send_now(seq: int) -> None:
            remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - issued))
            try:
                call = send(seq, remaining)
            except Exception as e:  # e.g. a closed channel
                fut.set_exception(e)
                return
            call.add_done_callback(finish)

        with self._lock:
            seq = 0
            if self.sequenced:
                seq = self._next_sequence
                self._next_sequence += 1
            fut.sequence = seq  # type: ignore[attr-defined]
            self._track(fut)
            gate = self._gate
            if gate is not None and not gate.done():
                gate.add_done_callback(lambda _: send_now(seq))
            else:
                send_now(seq)
        return fut

    def _track(self, fut: concurrent.futures.Future) -> None:
        # REQUIRES: self._lock held. issue_index: the call's place in issue order (push_rollouts
        # included, which has no sequence number).
        fut.issue_index = self._issued  # type: ignore[attr-defined]
        self._issued += 1
        self._pending.add(fut)
        fut.add_done_callback(self._untrack)

    def _untrack(self, fut: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.discard(fut)
            if fut.exception() is not None:
                self._failures.append(fut)

    def _send(self, stub_method, request_of: Callable[[int], object]):
        md = self.client.metadata
        return lambda seq, timeout: stub_method.future(request_of(seq), timeout=timeout, metadata=md)

    @property
    def next_sequence(self) -> int:
        """The sequence number the next call gets (0 when the session is not sequenced)."""
        return self._next_sequence if self.sequenced else 0

    def forward_backward(self, batch: BatchLike, loss: LossLike = "cross_entropy", clip_low: Optional[float] = None,
                         clip_high: Optional[float] = None, timeout: Optional[float] = None
                         ) -> "concurrent.futures.Future[ForwardBackwardResult]":
        """Runs the model on `batch` and adds the gradient of `loss` (gradients of successive
        calls add up until optim_step). loss: "cross_entropy" | "importance_sampling" | "ppo" (or
        a Loss); clip_low/clip_high: PPO's clip range (None = 0.2). Result: ForwardBackwardResult
        (the logprobs are from before this call's update)."""
        spec = Loss.of(loss)
        if clip_low is not None or clip_high is not None:
            spec = Loss(spec.kind, clip_low if clip_low is not None else spec.clip_low,
                        clip_high if clip_high is not None else spec.clip_high)
        _checks.check_loss(spec.kind, spec.clip_low, spec.clip_high)
        data = batch_to_proto(batch)
        _checks.check_batch(data, self.max_positions)
        loss_pb = spec.to_proto()
        req = lambda seq: pb.ForwardBackwardRequest(job=self.name, batch=data, loss=loss_pb, sequence=seq)  # noqa: E731
        return self._issue("ForwardBackward", self._send(self.client.training.ForwardBackward, req),
                           ForwardBackwardResult.from_proto, timeout)

    def optim_step(self, lr: float, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8,
                   weight_decay: float = 0.0, timeout: Optional[float] = None
                   ) -> "concurrent.futures.Future[OptimStepResult]":
        """Applies one AdamW step with the accumulated gradients and clears them."""
        _checks.check_adam(lr, beta1, beta2, eps, weight_decay)
        adam = AdamW(lr, beta1, beta2, eps, weight_decay).to_proto()
        req = lambda seq: pb.OptimStepRequest(job=self.name, adam=adam, sequence=seq)  # noqa: E731
        return self._issue("OptimStep", self._send(self.client.training.OptimStep, req),
                           OptimStepResult.from_proto, timeout)

    def forward(self, batch: BatchLike, timeout: Optional[float] = None) -> "concurrent.futures.Future[ForwardResult]":
        """The model's logprob of every target token of `batch` (tokens and target_tokens are
        used; no gradient)."""
        data = batch_to_proto(batch)
        _checks.check_batch(data, self.max_positions)
        req = lambda seq: pb.ForwardRequest(job=self.name, batch=data, sequence=seq)  # noqa: E731
        return self._issue("Forward", self._send(self.client.training.Forward, req), ForwardResult.from_proto, timeout)

    def save_checkpoint(self, directory: Optional[str] = None, timeout: Optional[float] = None
                        ) -> "concurrent.futures.Future[CheckpointResult]":
        """Writes weights + optimizer state to `directory` (a path the worker can write; None =
        <the job's checkpoint directory>/step-<N>)."""
        _checks.check_directory(directory, required=False)
        req = lambda seq: pb.SaveCheckpointRequest(job=self.name, directory=directory or "", sequence=seq)  # noqa: E731
        return self._issue("SaveCheckpoint", self._send(self.client.training.SaveCheckpoint, req),
                           lambda r: CheckpointResult(r.directory, r.step), timeout)

    def load_checkpoint(self, directory: str, timeout: Optional[float] = None
                        ) -> "concurrent.futures.Future[CheckpointResult]":
        """Restores weights + optimizer state from a directory save_checkpoint wrote."""
        _checks.check_directory(directory, required=True)
        req = lambda seq: pb.LoadCheckpointRequest(job=self.name, directory=directory, sequence=seq)  # noqa: E731
        return self._issue("LoadCheckpoint", self._send(self.client.training.LoadCheckpoint, req),
                           lambda r: CheckpointResult(directory, r.step), timeout)

    def export_weights(self, directory: str, dtype: Optional[str] = None, timeout: Optional[float] = None
                       ) -> "concurrent.futures.Future[str]":
        """Writes the current weights as a Hugging Face directory (config.json +
        model.safetensors) that transformers / vLLM / SGLang load; dtype: None (the session's),
        "float32" or "bfloat16". Result: the directory written."""
        _checks.check_directory(directory, required=True)
        _checks.check_dtype(dtype)
        req = lambda seq: pb.ExportWeightsRequest(job=self.name, directory=directory, dtype=dtype or "",  # noqa: E731
                                                  sequence=seq)
        return self._issue("ExportWeights", self._send(self.client.training.ExportWeights, req),
                           lambda r: r.directory, timeout)

    def sample(self, prompts: Sequence[Sequence[int]], num_samples: int = 1,
               sampling_params: Union[SamplingParams, dict, None] = None, timeout: Optional[float] = None
               ) -> "concurrent.futures.Future[SampleResponse]":
        """Samples num_samples continuations of each prompt (a list of token-id lists) from the
        session's current weights: those after every call issued before this one (KV-cache
        decoding on the session's worker; rank 0 of a data-parallel session). Result:
        SampleResponse, prompt-major. Bad parameters or token ids come back as the future's
        OdysseyError (INVALID_ARGUMENT naming the field)."""
        params = SamplingParams.of(sampling_params)
        prompts_pb = [pb.SamplePrompt(tokens=[int(t) for t in p]) for p in prompts]
        _checks.check_prompts(prompts_pb)
        params_pb = params.to_proto()
        req = lambda seq: pb.SampleRequest(job=self.name, prompts=prompts_pb, num_samples=int(num_samples),  # noqa: E731
                                           params=params_pb, sequence=seq)
        return self._issue("Sample", self._send(self.client.training.Sample, req), SampleResponse.from_proto, timeout)

    def compute_logprobs(self, prompt: Sequence[int], timeout: Optional[float] = None
                         ) -> "concurrent.futures.Future[List[Optional[float]]]":
        """Tinker's compute_logprobs, through Forward: the model's logprob of each token of
        `prompt` given the tokens before it; the first token has no context (None)."""
        tokens = [int(t) for t in prompt]
        if len(tokens) < 2:
            # Nothing to score: no call is made (the sequence number is not used).
            fut: concurrent.futures.Future = AwaitableFuture()
            fut.set_running_or_notify_cancel()
            fut.set_result([None] * len(tokens))
            return fut
        inner = self.forward([Datum.from_sequence(tokens)], timeout=timeout)
        out: concurrent.futures.Future = AwaitableFuture()
        out.set_running_or_notify_cancel()

        def done(f: concurrent.futures.Future) -> None:
            if f.exception() is not None:
                out.set_exception(f.exception())
            else:
                out.set_result([None] + list(f.result().logprobs[0]))
        inner.add_done_callback(done)
        return out

    def create_sampling_client(self) -> "SamplingClient":
        """A SamplingClient of this session: its calls share this client's order, so a sample
        issued after an optim_step sees the updated weights."""
        return SamplingClient(self)

    # asyncio twins (Tinker's `*_async` names): each issues the call when the coroutine runs
    # and returns its AwaitableFuture, so `fut = await tc.forward_backward_async(...)` takes
    # its place in the order and `await fut` gives the result.
    async def forward_backward_async(self, *args, **kwargs) -> AwaitableFuture:
        return self.forward_backward(*args, **kwargs)

    async def optim_step_async(self, *args, **kwargs) -> AwaitableFuture:
        return self.optim_step(*args, **kwargs)

    async def forward_async(self, *args, **kwargs) -> AwaitableFuture:
        return self.forward(*args, **kwargs)

    async def save_checkpoint_async(self, *args, **kwargs) -> AwaitableFuture:
        return self.save_checkpoint(*args, **kwargs)

    async def load_checkpoint_async(self, *args, **kwargs) -> AwaitableFuture:
        return self.load_checkpoint(*args, **kwargs)

    async def export_weights_async(self, *args, **kwargs) -> AwaitableFuture:
        return self.export_weights(*args, **kwargs)

    async def sample_async(self, *args, **kwargs) -> AwaitableFuture:
        return self.sample(*args, **kwargs)

    async def compute_logprobs_async(self, *args, **kwargs) -> AwaitableFuture:
        return self.compute_logprobs(*args, **kwargs)

    async def push_rollouts_async(self, *args, **kwargs) -> AwaitableFuture:
        return self.push_rollouts(*args, **kwargs)

    async def wait_running_async(self, timeout: Optional[float] = 300.0) -> JobInfo:
        return await asyncio.to_thread(self.wait_running, timeout)

    async def close_async(self) -> None:
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> "TrainingClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close_async()

    def push_rollouts(self, rollouts: Iterable[Tuple[BatchLike, LossLike, AdamLike]],
                      on_result: Optional[Callable[[RolloutResult], None]] = None, timeout: Optional[float] = None
                      ) -> "concurrent.futures.Future[List[RolloutResult]]":
        """Streams (batch, loss, adam) triples: each is a forward_backward with `loss` followed by
        an optim_step with `adam` (an AdamW, a dict of its fields, or a learning rate). The
        iterable may be a generator that yields as rollouts are produced; `on_result` is called
        with each result as it arrives. Result: the list of RolloutResult. On a failing batch the
        stream stops and the Future raises OdysseyError; its `partial_results` holds the results
        of the batches before it.

        Ordering: the stream opens after every call issued before it has finished, and calls
        issued after it are sent when it ends (the stream carries no sequence numbers)."""
        fut: concurrent.futures.Future = AwaitableFuture()
        fut.set_running_or_notify_cancel()
        timeout = self.client.call_timeout if timeout is None else timeout

        bad_input: List[BaseException] = []  # raised while producing requests (on gRPC's thread)

        def requests():
            try:
                yield from produce()
            except Exception as e:
                bad_input.append(e)
                raise

        def produce():
            for i, item in enumerate(rollouts):
                try:
                    batch, loss, adam = item
                except (TypeError, ValueError):
                    raise TypeError(f"rollouts[{i}] must be a (batch, loss, adam) triple") from None
                spec, opt, data = Loss.of(loss), AdamW.of(adam), batch_to_proto(batch)
                _checks.check_loss(spec.kind, spec.clip_low, spec.clip_high, f"rollouts[{i}].loss")
                _checks.check_adam(opt.lr, opt.beta1, opt.beta2, opt.eps, opt.weight_decay, f"rollouts[{i}].adam")
                _checks.check_batch(data, self.max_positions, f"rollouts[{i}].batch")
                yield pb.RolloutBatch(job=self.name, batch=data, loss=spec.to_proto(), adam=opt.to_proto())

        def run(before: List[concurrent.futures.Future]) -> None:
            concurrent.futures.wait(before)
            results: List[RolloutResult] = []
            try:
                stream = self.client.training.PushRollouts(requests(), timeout=timeout, metadata=self.client.metadata)
                for r in stream:
                    res = RolloutResult.from_proto(r)
                    results.append(res)
                    if on_result is not None:
                        on_result(res)
                fut.set_result(results)
            except grpc.RpcError as e:
                # A bad rollout from the caller's iterable cancels the stream: report that, not
                # the cancellation it caused.
                err = bad_input[0] if bad_input else OdysseyError.from_rpc_error(e, "PushRollouts", self.name)
                err.partial_results = results  # type: ignore[attr-defined]
                fut.set_exception(err)
            except Exception as e:  # a bad rollout from the caller's iterable, or on_result raised
                e.partial_results = results  # type: ignore[attr-defined]
                fut.set_exception(e)

        with self._lock:
            before = list(self._pending)
            prev_gate = self._gate
            if prev_gate is not None and not prev_gate.done():
                before.append(prev_gate)
            fut.sequence = 0  # type: ignore[attr-defined]
            self._track(fut)
            self._gate = fut
        threading.Thread(target=run, args=(before,), name=f"push_rollouts {self.name}", daemon=True).start()
        return fut


Session = TrainingClient  # the former name


class SamplingClient:
    """Sampling from an RL session's current weights (Tinker's SamplingClient). Made by
    TrainingClient.create_sampling_client() or ServiceClient.create_sampling_client(job). Its
    calls are its TrainingClient's calls (one order). Unlike Tinker's, it is not pinned to saved
    weights: each sample sees the weights after every call issued before it; export_weights
    writes a folder for an external engine (vLLM) instead."""

    def __init__(self, training_client: TrainingClient):
        self.training_client = training_client

    def __repr__(self) -> str:
        return f"SamplingClient({self.training_client.name!r})"

    def sample(self, prompt: Optional[Sequence[int]] = None, num_samples: int = 1,
               sampling_params: Union[SamplingParams, dict, None] = None, *,
               prompts: Optional[Sequence[Sequence[int]]] = None, timeout: Optional[float] = None
               ) -> "concurrent.futures.Future[SampleResponse]":
        """num_samples continuations of `prompt` (token ids), or of each of `prompts` in one
        batched call. Result: SampleResponse (prompt-major sequences)."""
        if (prompt is None) == (prompts is None):
            raise ValueError("give either prompt (one token list) or prompts (a list of them)")
        return self.training_client.sample([prompt] if prompts is None else prompts, num_samples, sampling_params,
                                           timeout=timeout)

    def compute_logprobs(self, prompt: Sequence[int], timeout: Optional[float] = None
                         ) -> "concurrent.futures.Future[List[Optional[float]]]":
        return self.training_client.compute_logprobs(prompt, timeout=timeout)

    async def sample_async(self, *args, **kwargs) -> AwaitableFuture:
        return self.sample(*args, **kwargs)

    async def compute_logprobs_async(self, *args, **kwargs) -> AwaitableFuture:
        return self.compute_logprobs(*args, **kwargs)
