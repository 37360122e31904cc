#!/usr/bin/env python3
"""The bounded soak test of issue 11 ("The service under faults and hostile input"): a real
odyssey-controller (--heartbeat-timeout 3) and three CPU odyssey-workers (the tiny model, one
torch thread each) run a seeded random schedule of SFT jobs, RL sessions driven through the
TrainingService and cancels, while one fault at a time is injected:

  kill -9 worker     SIGKILL of a worker (preferably one running a job), then a restart with
                     the same --worker-id after 0-2 s.
  SIGSTOP worker     the worker is stopped for longer than the heartbeat timeout (the controller
                     declares it dead and restarts its job elsewhere), then SIGCONT: it comes
                     back holding a job the controller gave up on and must get no new work until
                     it has stopped that one.
  SIGTERM worker     the worker shuts down (as when its pod is deleted): it stops its job between
                     steps, reports it as the worker leaving (the controller restarts the job
                     elsewhere at once) and must exit 0 within SIGTERM_EXIT_S; then a restart
                     with the same --worker-id after 0-2 s.
  kill -9 controller SIGKILL of the controller, then a restart on the same port and state dir
                     after 0.5-3 s (only in the first 60% of the schedule, so the controller
                     process measured at the end has lived through faults and load).

Then, with every fault over and a deadline on every wait, it checks:
  - no job lost: every job a CreateJob answered (retried with its request_id while the
    controller was down) is listed, once, with its spec, and in a terminal state;
  - each state matches what happened: a cancelled job CANCELLED; any other job SUCCEEDED (an
    SFT job at its last step, with its last checkpoint the step-<steps> folder), unless it ran
    out of restarts: FAILED with an error naming "restart_limit (L) reached", restarts == L, and
    at least L + 1 faults during its life (counted separately). Any other FAILED (a worker
    that was "busy", "re-attached without the job", an engine error), a CANCELLED job nobody
    cancelled, or more restarts than faults during the job's life is a violation;
  - RL calls failed only the ways a fault explains (UNAVAILABLE, ABORTED, FAILED_PRECONDITION
    naming the state or the missing forward_backward); none waited past its deadline; every
    optim_step's step number follows the one before or, after a restart, a checkpoint at least
    as new as the newest save_checkpoint answered;
  - every last_checkpoint a job names exists, lies in that job's own folder, and is whole:
    config.json and trainer_state.json parse (the step matches the folder's name), every
    .safetensors header parses and its tensors end at the file's end; one SFT and one RL
    checkpoint load in transformers. The last_checkpoint seen when a job ended still exists at
    the end (no run, of this job or another, deleted it);
  - no worker is stuck: the controller's odyssey_workers gauges say 3 idle, 0 busy,
    0 disconnected, each worker's own /metrics says connected and not busy, and a final short
    SFT job per worker succeeds;
  - the controller's threads and RSS (/proc/<pid>/status) at the end are near where they were
    after the warm-up (see THREADS_SLACK / RSS_SLACK_MIB).

Prints the seed first (rerun one with --seed), one line per fault, and one summary line:
  soak: N jobs (S SFT, R RL), F faults (k kill -9 worker, s SIGSTOP, t SIGTERM, c controller kill -9),
  jobs lost 0, checkpoints missing 0, threads A->B, RSS X->Y MiB, T s
Exits 1 with the details on any violation.
"""
import json
import math
import os
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (Failure, arg_parser, free_port_base, parse_args, run_test, scrape, wait_for,  # noqa: E402
                     wait_for_port_file)
from rl_test import RlCluster  # noqa: E402

HEARTBEAT_TIMEOUT_S = 3
WORKERS = ("w1", "w2", "w3")
WORKER_FAULTS = ("kill -9 worker", "SIGSTOP worker", "SIGTERM worker")
SIGTERM_EXIT_S = 30  # a worker stops between steps (tiny CPU steps: well under a second)
MAX_ACTIVE = 5  # jobs PENDING or RUNNING at once: enough to queue, few enough to drain at the end
RL_CALL_TIMEOUT_S = 30  # a TrainingService call waiting longer than this is a violation
RL_IDLE_TIMEOUT_S = 4  # sessions end SUCCEEDED this long after the driver's last call
# The controller at the end against the one after the warm-up (the one at the end is usually a
# restarted process that has lived through the last 40% of the schedule). Threads: the sync server
# holds one per open stream (the three Attach streams, both times) plus a few pollers that come
# and go (hostile_process_test allows 8 above its start); runs measured 28 -> 28 or 29. RSS: the
# process at the end also holds every job of the soak (a few KiB each) and SQLite's page cache;
# runs measured 23 -> 23-24 MiB. 16 MiB is far above that noise and below what a leak per
# stream or per call would add over a run's ~25 jobs, ~10 reconnects and ~500 calls.
THREADS_SLACK = 8
RSS_SLACK_MIB = 16
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


class Job:
    """What the test knows about one job it created."""

    def __init__(self, name, kind, spec, request_id):
        self.name = name
        self.kind = kind  # "SFT" or "RL"
        self.spec = spec  # the JobSpec proto sent
        self.request_id = request_id
        self.created = time.monotonic()
        self.ended = None  # monotonic time it was first seen terminal
        self.cancel = None  # None, "done" (CancelJob answered) or "maybe" (the answer was lost)
        self.seen_end_state = ""  # the state it was first seen terminal in
        self.seen_end_checkpoint = ""  # and its last_checkpoint then
        self.rl_rounds = 0
        self.rl_errors = []  # (code name, message) of RL calls that failed


class Fault:
    def __init__(self, kind, target, start):
        self.kind = kind  # "kill -9 worker", "SIGSTOP worker", "SIGTERM worker", "kill -9 controller"
        self.target = target
        self.start = start
        self.end = None
        self.jobs = []  # what the victim ran (from the latest listing; may be stale)


class Soak(RlCluster):
    def __init__(self, args, workdir):
        super().__init__(args, workdir)
        self.lock = threading.Lock()
        self.records = {}  # name -> Job
        self.faults = []
        self.violations = []
        self.running = {}  # worker id -> job name, from the monitor's latest listing
        self.channel = None
        self.controller_pids = []

    # ----- processes ---------------------------------------------------------------------------

    def start_controller(self):
        """Starts (or restarts, on the same port and state dir) the controller. One channel for
        the whole run, reconnecting fast, so threads in flight keep their stubs across restarts."""
        for f in ("controller.port", "controller.metrics-port"):
            if os.path.exists(os.path.join(self.workdir, f)):
                os.remove(os.path.join(self.workdir, f))
        if not hasattr(self, "rendezvous_base"):
            self.rendezvous_base = free_port_base()
        self.controller = self.spawn("controller", [
            self.args.controller, "--listen", f"127.0.0.1:{self.port}",
            "--port-file", os.path.join(self.workdir, "controller.port"), "--state-dir", self.state_dir,
            "--metrics-listen", "127.0.0.1:0",
            "--metrics-port-file", os.path.join(self.workdir, "controller.metrics-port"),
            "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S), "--rendezvous-port-base", str(self.rendezvous_base)])
        self.controller_pids.append(self.controller.pid)
        self.port = wait_for_port_file(os.path.join(self.workdir, "controller.port"), "the controller's port file")
        self.metrics_port = wait_for_port_file(os.path.join(self.workdir, "controller.metrics-port"),
                                               "the controller's metrics port")
        if self.channel is None:
            self.address = f"127.0.0.1:{self.port}"
            self.channel = self.grpc.insecure_channel(self.address, options=[
                ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 500)])
            self.jobs = self.pbg.JobServiceStub(self.channel)
            self.training = self.pbg.TrainingServiceStub(self.channel)

    def kill_controller(self):
        self.controller.send_signal(signal.SIGKILL)
        self.controller.wait()

    def start_worker(self, worker_id):
        """Starts (or restarts) a worker; returns its metrics port (a new one each start)."""
        port_file = os.path.join(self.workdir, f"{worker_id}.metrics-port")
        if os.path.exists(port_file):
            os.remove(port_file)
        return super().start_worker(worker_id)

    def worker_metrics_port(self, worker_id):
        return wait_for_port_file(os.path.join(self.workdir, f"{worker_id}.metrics-port"),
                                  f"{worker_id}'s metrics port")

    # ----- calls that outlive a controller restart ------------------------------------------------

    def retry(self, what, call, timeout=60):
        """call() until it does not fail UNAVAILABLE (the controller down or restarting)."""
        end = time.monotonic() + timeout
        while True:
            try:
                return call()
            except self.grpc.RpcError as e:
                if e.code() != self.grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                    raise Failure(f"{what}: {e.code().name} {e.details()}")
            time.sleep(0.1)

    def get(self, name):
        return self.retry(f"GetJob {name}", lambda: self.jobs.GetJob(self.pb.GetJobRequest(name=name), timeout=10))

    def list_all(self):
        jobs, token = [], ""
        while True:
            r = self.retry("ListJobs", lambda: self.jobs.ListJobs(
                self.pb.ListJobsRequest(page_size=1000, page_token=token), timeout=10))
            jobs += r.jobs
            token = r.next_page_token
            if not token:
                return jobs

    def create(self, kind, spec, cli=False):
        """CreateJob with a request id, retried across a controller restart: one job per call.
        With `cli`, `odyssey submit --request-id` of the spec as JSON instead (once)."""
        request_id = f"soak-{len(self.records)}-{time.monotonic_ns()}"
        if cli:
            from google.protobuf import json_format
            path = os.path.join(self.workdir, f"{request_id}.json")
            with open(path, "w") as f:
                f.write(json_format.MessageToJson(spec))
            out = subprocess.run([self.args.cli, "--controller", self.address, "submit", "--request-id", request_id,
                                  path], capture_output=True, text=True, timeout=60)
            m = re.search(r"jobs/\d+", out.stdout)
            if out.returncode != 0 or not m:
                raise Failure(f"odyssey submit failed ({out.returncode}): {out.stdout}{out.stderr}")
            name = m.group(0)
        else:
            name = self.retry("CreateJob", lambda: self.jobs.CreateJob(
                self.pb.CreateJobRequest(spec=spec, request_id=request_id), timeout=10)).name
        rec = Job(name, kind, spec, request_id)
        with self.lock:
            if name in self.records:
                self.violations.append(f"CreateJob {request_id} answered {name}, already another call's job")
            self.records[name] = rec
        return rec

    def state(self, job):
        return self.pb.Job.State.Name(job.state)

    # ----- the load --------------------------------------------------------------------------------

    def sft_spec(self, i, steps, every, restart_limit, own_folder, world_size=1):
        spec = self.pb.JobSpec(kind=self.pb.SFT, display_name=f"soak-sft-{i}", steps=steps, restart_limit=restart_limit)
        spec.parallel.world_size = world_size
        spec.model.name, spec.model.dtype = "tiny", "float32"
        spec.optimizer.lr, spec.optimizer.warmup_steps, spec.optimizer.grad_clip = 3e-3, 5, 1.0
        spec.data.format, spec.data.seq_len, spec.data.batch_size, spec.data.seed = "kjv", 32, 4, i
        spec.checkpoint.every_steps, spec.checkpoint.keep = every, 2
        if own_folder:  # else the controller's default, <state>/checkpoints/job-N
            spec.checkpoint.directory = os.path.join(self.workdir, "ckpt", f"sft-{i}")
        return spec

    def rl_spec(self, i, restart_limit):
        spec = self.pb.JobSpec(kind=self.pb.RL_SESSION, display_name=f"soak-rl-{i}", restart_limit=restart_limit)
        spec.model.name, spec.model.dtype = "tiny", "float32"
        spec.data.seq_len, spec.data.batch_size = 64, 4
        spec.optimizer.grad_clip = 1.0
        spec.rl.idle_timeout_seconds = RL_IDLE_TIMEOUT_S
        spec.checkpoint.directory = os.path.join(self.workdir, "ckpt", f"rl-{i}")
        spec.checkpoint.keep = 2
        return spec

    def drive_session(self, rec, rounds, seed, deadline):
        """forward_backward + optim_step `rounds` times (save_checkpoint after every second one
        and the last), 0.2-1 s apart (a sampler's turn), riding out faults; then lets the
        session idle out. Every optim_step's step number must follow the one before, or, after
        a restart, a checkpoint at least as new as the newest save answered."""
        pb, codes = self.pb, self.grpc.StatusCode
        batch = self.batch(seed=seed)
        think = random.Random(seed)
        at = {0}  # the steps the session may be at (an optim_step whose answer was lost may have run)
        saved = set()  # steps a save_checkpoint was sent at (answered or not)
        newest_answered = 0  # the step of the newest save_checkpoint answered OK
        expected_precondition = (" is PENDING", " is CANCELLED", " is SUCCEEDED", " is FAILED", "forward_backward")
        while rec.rl_rounds < rounds and time.monotonic() < deadline:
            try:
                job = self.jobs.GetJob(pb.GetJobRequest(name=rec.name), timeout=10)
            except self.grpc.RpcError:
                time.sleep(0.2)  # the controller is down: ask again
                continue
            if self.state(job) in TERMINAL:
                return  # cancelled, or it idled out while a fault held the driver back
            if self.state(job) != "RUNNING":
                time.sleep(0.2)
                continue
            try:
                self.training.ForwardBackward(pb.ForwardBackwardRequest(
                    job=rec.name, batch=batch, loss=pb.LossConfig(kind="cross_entropy")), timeout=RL_CALL_TIMEOUT_S)
                try:
                    step = self.training.OptimStep(pb.OptimStepRequest(job=rec.name, adam=pb.AdamWParams(lr=1e-2)),
                                                   timeout=RL_CALL_TIMEOUT_S).step
                except self.grpc.RpcError:
                    at |= {s + 1 for s in at}
                    raise
                resumed = {s for s in saved | {0} if s >= newest_answered}
                if step - 1 not in at | resumed:
                    with self.lock:
                        self.violations.append(f"{rec.name}: optim_step returned step {step}; the session was at "
                                               f"{sorted(at)}, or resumed from one of {sorted(resumed)}")
                at = {step}
                if rec.rl_rounds % 2 == 1 or rec.rl_rounds == rounds - 1:
                    saved.add(step)
                    r = self.training.SaveCheckpoint(pb.SaveCheckpointRequest(job=rec.name), timeout=RL_CALL_TIMEOUT_S)
                    newest_answered = r.step
                rec.rl_rounds += 1
                time.sleep(think.uniform(0.2, 1.0))  # well under the idle timeout
            except self.grpc.RpcError as e:
                details = e.details() or ""
                rec.rl_errors.append((e.code().name, details))
                explained = e.code() in (codes.UNAVAILABLE, codes.ABORTED) or (
                    e.code() == codes.FAILED_PRECONDITION and any(s in details for s in expected_precondition))
                if not explained:
                    with self.lock:
                        self.violations.append(f"{rec.name}: an RL call failed {e.code().name}: {details}")
                    return
                time.sleep(0.2)

    # ----- watching ----------------------------------------------------------------------------------

    def observe(self):
        """One listing: which worker runs what (the faults' victims), and each job's end."""
        try:
            jobs = self.jobs.ListJobs(self.pb.ListJobsRequest(page_size=1000), timeout=5).jobs
        except self.grpc.RpcError:
            return None  # the controller is down
        running = {}
        now = time.monotonic()
        with self.lock:
            for j in jobs:
                if self.state(j) == "RUNNING":
                    for w in j.workers:
                        running[w] = j.name
                rec = self.records.get(j.name)
                if rec and rec.ended is None and self.state(j) in TERMINAL:
                    rec.ended = now
                    rec.seen_end_state = self.state(j)
                    rec.seen_end_checkpoint = j.last_checkpoint
            self.running = running
        return jobs


def fault_plan(rng, duration):
    """[(second, kind)]: one fault every 6-10 s from t = 5 until 6 s before the end, at least one of
    each kind; controller kills (at most 2) only in the first 60%."""
    times = []
    t = 5.0
    while t < duration - 6:
        times.append(t)
        t += rng.uniform(6, 10)
    kinds = []
    early = [i for i, t in enumerate(times) if t < 0.6 * duration]
    n_ctl = min(2, max(1, len(early) // 2))
    ctl = set(rng.sample(early, n_ctl)) if early else set()
    rest = [i for i in range(len(times)) if i not in ctl]
    for i in range(len(times)):
        kinds.append("kill -9 controller" if i in ctl else None)
    # The others cycle through the worker faults in a random order, so each appears.
    order = rng.sample(WORKER_FAULTS, len(WORKER_FAULTS))
    for n, i in enumerate(rest):
        kinds[i] = order[n % len(order)]
    return list(zip(times, kinds))


def run_faults(c, plan, rng, t0, stop):
    for at, kind in plan:
        while time.monotonic() < t0 + at:
            if stop.is_set():
                return
            time.sleep(0.05)
        c.observe()  # who runs what right now
        with c.lock:
            running = dict(c.running)
        if kind == "kill -9 controller":
            f = Fault(kind, "controller", time.monotonic())
            f.jobs = sorted(set(running.values()))
            c.faults.append(f)
            c.kill_controller()
            down = rng.uniform(0.5, 3)
            time.sleep(down)  # the controller stays down this long: the schedule, not a wait
            c.start_controller()
            what = f"down {down:.1f} s, RUNNING then: {f.jobs}"
        else:
            busy = sorted(running)
            victim = rng.choice(busy) if busy else rng.choice(WORKERS)
            f = Fault(kind, victim, time.monotonic())
            f.jobs = [running[victim]] if victim in running else []
            c.faults.append(f)
            p = c.workers[victim]
            if kind == "kill -9 worker":
                c.kill_worker(victim)
                down = rng.uniform(0, 2)
                time.sleep(down)
                c.start_worker(victim)
                what = f"{victim} (running {f.jobs or 'nothing'}) down {down:.1f} s"
            elif kind == "SIGTERM worker":
                c.workers.pop(victim)
                p.send_signal(signal.SIGTERM)
                try:
                    rc = p.wait(timeout=SIGTERM_EXIT_S)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
                    rc = "still running (killed)"
                if rc != 0:
                    c.violations.append(f"{victim} after SIGTERM: exit {rc}, want 0 within {SIGTERM_EXIT_S} s")
                down = rng.uniform(0, 2)
                time.sleep(down)
                c.start_worker(victim)
                what = f"{victim} (running {f.jobs or 'nothing'}) exited {rc}, down {down:.1f} s"
            else:
                held = HEARTBEAT_TIMEOUT_S + rng.uniform(1, 2.5)
                p.send_signal(signal.SIGSTOP)
                try:
                    time.sleep(held)
                finally:
                    p.send_signal(signal.SIGCONT)
                what = f"{victim} (running {f.jobs or 'nothing'}) stopped {held:.1f} s"
        f.end = time.monotonic()
        print(f"  t={f.start - t0:5.1f}s fault {len(c.faults)}: {kind} {what}", flush=True)


def proc_status(pid):
    """(threads, RSS in MiB) of a process from /proc/<pid>/status."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            fields[k] = v.strip()
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) / 1024


def check_checkpoint(path):
    """Why the checkpoint folder at `path` is not whole, or "" when it is."""
    if not os.path.isdir(path):
        return "does not exist"
    names = set(os.listdir(path))
    for need in ("config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"):
        if need not in names:
            return f"has no {need} ({sorted(names)})"
    try:
        with open(os.path.join(path, "config.json")) as f:
            json.load(f)
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
    except ValueError as e:
        return f"a JSON file does not parse: {e}"
    m = re.search(r"step-(\d+)$", path)
    if m and int(m.group(1)) != state.get("step"):
        return f"trainer_state.json says step {state.get('step')}"
    for name in names:
        if not name.endswith(".safetensors"):
            continue
        file = os.path.join(path, name)
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                return f"{name}: header does not parse: {e}"
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end != os.path.getsize(file):
            return f"{name}: tensors end at byte {8 + n + end}, the file has {os.path.getsize(file)}"
    return ""


def load_in_transformers(path, below):
    """Loads the checkpoint at `path` in transformers; its loss on a verse must be under `below`
    (and finite)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([list(b"In the beginning God created the heaven and the earth.")])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    if not loss < below:
        raise Failure(f"transformers loads {path} but its loss on Genesis 1:1 is {loss}, want < {below:.2f}")
    return loss


def soak(c, args):
    seed = args.seed
    rng = random.Random(seed)
    print(f"soak: seed {seed} (rerun with --seed {seed}), duration {args.duration:.0f} s", flush=True)
    t_start = time.monotonic()
    # transformers takes 5-25 s to import on a busy 2-core machine: it loads beside the soak.
    preload = threading.Thread(target=lambda: __import__("transformers").AutoModelForCausalLM, daemon=True)
    preload.start()
    c.start_controller()
    for w in WORKERS:
        c.start_worker(w)
    # Warm-up: one short job per worker, then the controller's baseline.
    warm = [c.create("SFT", c.sft_spec(1000 + k, 5, 0, 0, True)) for k in range(len(WORKERS))]
    for rec in warm:
        wait_for(f"warm-up {rec.name}", lambda: c.state(c.get(rec.name)) in TERMINAL, timeout=120)
        if c.state(c.get(rec.name)) != "SUCCEEDED":
            raise Failure(f"warm-up {rec.name} ended {c.state(c.get(rec.name))}: {c.get(rec.name).error}")
    wait_for("3 idle workers after the warm-up",
             lambda: scrape(c.metrics_port).get('odyssey_workers{state="idle"}') == 3, timeout=60)
    threads0, rss0 = proc_status(c.controller.pid)
    print(f"warm-up done in {time.monotonic() - t_start:.1f} s: controller threads {threads0}, RSS {rss0:.1f} MiB",
          flush=True)

    faults = fault_plan(rng, args.duration)
    n_faults = len(faults)
    stop = threading.Event()
    t0 = time.monotonic()
    fault_errors = []

    def faults_main():
        try:
            run_faults(c, faults, random.Random(seed + 1), t0, stop)
        except Exception as e:  # noqa: BLE001 (reported as a violation below)
            fault_errors.append(repr(e))
    fault_thread = threading.Thread(target=faults_main, daemon=True)
    fault_thread.start()

    drivers = []
    n_sft = n_rl = 0
    deadline_load = t0 + args.duration - 15  # no new job after this: the queue drains by the end
    while time.monotonic() < t0 + args.duration:
        jobs = c.observe()
        if jobs is not None and time.monotonic() < deadline_load:
            with c.lock:
                active = [r for r in c.records.values() if r.ended is None and r.cancel is None]
            r = rng.random()
            if r < 0.07 and active:
                victim = rng.choice(active)
                try:
                    got = c.jobs.CancelJob(c.pb.CancelJobRequest(name=victim.name), timeout=10)
                    victim.cancel = "done" if c.state(got) == "CANCELLED" else None
                except c.grpc.RpcError as e:
                    if e.code() != c.grpc.StatusCode.FAILED_PRECONDITION:  # FAILED_PRECONDITION: it ended first
                        victim.cancel = "maybe"  # the answer was lost; the cancel may have happened
                print(f"  t={time.monotonic() - t0:5.1f}s cancel {victim.name} ({victim.kind}): {victim.cancel}",
                      flush=True)
            elif len(active) < MAX_ACTIVE:
                # A few jobs may run out of restarts (0 or 1); the rest allow every fault planned.
                restart_limit = rng.choice([0, 1]) if rng.random() < 0.15 else n_faults
                if rng.random() < 0.35:
                    n_rl += 1
                    rec = c.create("RL", c.rl_spec(n_rl, restart_limit))
                    rounds = rng.randint(4, 10)
                    t = threading.Thread(target=c.drive_session, daemon=True,
                                         args=(rec, rounds, seed * 1000 + n_rl, t0 + args.duration + 30))
                    t.start()
                    drivers.append(t)
                    print(f"  t={time.monotonic() - t0:5.1f}s RL  {rec.name}: {rounds} rounds, "
                          f"restart_limit {restart_limit}", flush=True)
                else:
                    n_sft += 1
                    steps = rng.randint(30, 150)
                    world_size = 2 if rng.random() < 0.15 else 1  # data parallel over two workers
                    rec = c.create("SFT", c.sft_spec(n_sft, steps, 10, restart_limit, rng.random() < 0.5, world_size))
                    print(f"  t={time.monotonic() - t0:5.1f}s SFT {rec.name}: {steps} steps on {world_size} worker(s), "
                          f"restart_limit {restart_limit}, "
                          f"checkpoints in {rec.spec.checkpoint.directory or 'the default folder'}", flush=True)
        time.sleep(rng.uniform(0.5, 1.5))  # the schedule's pace, not a wait for anything
    stop.set()
    fault_thread.join(timeout=60)
    if fault_thread.is_alive():
        raise Failure("the fault thread did not finish")
    if fault_errors:
        raise Failure(f"injecting a fault failed: {fault_errors}")
    print(f"load and faults done at t={time.monotonic() - t0:.1f}s; settling", flush=True)

    # Settle: drivers end, every job ends, every worker idle.
    for t in drivers:
        t.join(timeout=max(1, t0 + args.duration + 40 - time.monotonic()))
    if any(t.is_alive() for t in drivers):
        raise Failure("an RL session driver is still running 40 s after the schedule")

    def all_ended():
        jobs = c.observe()
        with c.lock:
            return jobs is not None and all(r.ended is not None for r in c.records.values())
    try:
        wait_for("every job to end", all_ended, timeout=90, poll=0.5)
    except Failure:
        with c.lock:
            left = {r.name: c.state(c.get(r.name)) for r in c.records.values() if r.ended is None}
        raise Failure(f"jobs not terminal 90 s after the schedule: {left}")
    settled_at = time.monotonic()

    def idle_fleet():
        m = scrape(c.metrics_port)
        return (m.get('odyssey_workers{state="idle"}') == 3 and m.get('odyssey_workers{state="busy"}') == 0 and
                m.get('odyssey_workers{state="disconnected"}') == 0)
    try:
        wait_for("3 idle workers", idle_fleet, timeout=30, poll=0.2)
    except Failure:
        m = scrape(c.metrics_port)
        c.violations.append("workers stuck at the end: " + ", ".join(f"{k} {v:.0f}" for k, v in m.items()
                                                                      if k.startswith("odyssey_workers")))
    for w in WORKERS:
        m = scrape(c.worker_metrics_port(w))
        if m.get("odyssey_worker_connected") != 1 or m.get("odyssey_worker_busy") != 0:
            c.violations.append(f"{w} at the end: connected {m.get('odyssey_worker_connected')}, "
                                f"busy {m.get('odyssey_worker_busy')}")
    # One short job per worker, through the CLI when there is one.
    final = [c.create("SFT", c.sft_spec(2000 + k, 5, 0, 0, True), cli=bool(c.args.cli)) for k in range(len(WORKERS))]
    for rec in final:
        wait_for(f"final {rec.name}", lambda: c.observe() is not None and rec.ended is not None, timeout=60, poll=0.2)
    ran_on = set()
    for rec in final:
        job = c.get(rec.name)
        ran_on.update(job.workers)
        if c.state(job) != "SUCCEEDED":
            c.violations.append(f"final job {rec.name} ended {c.state(job)}: {job.error}")
    wait_for("3 idle workers after the final jobs", idle_fleet, timeout=30, poll=0.2)
    threads1, rss1 = proc_status(c.controller.pid)
    print(f"every job ended {settled_at - t0 - args.duration:.1f} s after the schedule; the final jobs "
          f"{time.monotonic() - settled_at:.1f} s later", flush=True)

    # ----- the verdict ---------------------------------------------------------------------------------
    listed = {j.name: j for j in c.list_all()}
    lost = sorted(set(c.records) - set(listed))
    extra = sorted(set(listed) - set(c.records))
    for name in lost:
        c.violations.append(f"{name} was created and is no longer listed")
    for name in extra:
        c.violations.append(f"{name} is listed but no CreateJob answered it (a request id retried twice?)")
    outcomes = {"SUCCEEDED": 0, "CANCELLED": 0, "FAILED (restart limit)": 0}
    missing = 0
    sft_ckpt = rl_ckpt = ""
    sft_restarted = False
    for name, rec in sorted(c.records.items(), key=lambda kv: int(kv[0].split("/")[1])):
        job = listed.get(name)
        if job is None:
            continue
        state = c.state(job)
        own = rec.spec.checkpoint.directory or os.path.join(c.state_dir, "checkpoints", f"job-{name.split('/')[1]}")
        faults_in_life = sum(1 for f in c.faults if f.start < (rec.ended or time.monotonic()) and f.end > rec.created)
        where = (f"{name} ({rec.kind}, restarts {job.restarts}/{rec.spec.restart_limit}, "
                 f"{faults_in_life} faults in its life)")
        took = job.end_time.ToDatetime() - job.create_time.ToDatetime()
        print(f"  {name}: {rec.kind}{'' if rec.kind == 'RL' else ' ' + str(rec.spec.steps) + ' steps'}"
              f"{' x2' if rec.spec.parallel.world_size == 2 else ''}, {state} at step {job.step}, restarts "
              f"{job.restarts}/{rec.spec.restart_limit}"
              f"{f', rendezvous retries {job.rendezvous_retries}' if job.rendezvous_retries else ''}"
              f", {took.total_seconds():.1f} s from create to end"
              f"{', cancelled' if rec.cancel else ''}{': ' + job.error if job.error else ''}")
        if job.spec.steps != rec.spec.steps or job.spec.kind != rec.spec.kind:
            c.violations.append(f"{where}: the spec changed")
        if job.restarts > faults_in_life:
            c.violations.append(f"{where}: restarted more often than faults happened while it lived")
        if rec.cancel == "done" and state != "CANCELLED":
            c.violations.append(f"{where}: cancelled, ended {state}: {job.error}")
        elif state == "CANCELLED" and rec.cancel is None:
            c.violations.append(f"{where}: CANCELLED and nobody cancelled it: {job.error}")
        elif state == "FAILED":
            limit = rec.spec.restart_limit
            if (f"restart_limit ({limit}) reached" not in job.error or job.restarts != limit or
                    faults_in_life < limit + 1):
                c.violations.append(f"{where}: FAILED: {job.error}")
            else:
                outcomes["FAILED (restart limit)"] += 1
        elif state == "SUCCEEDED":
            outcomes["SUCCEEDED"] += 1
            if rec.kind == "SFT" and (job.step != rec.spec.steps or
                                      not job.last_checkpoint.endswith(f"step-{rec.spec.steps:08d}")):
                c.violations.append(f"{where}: SUCCEEDED at step {job.step} with checkpoint {job.last_checkpoint!r}")
        elif state == "CANCELLED":
            outcomes["CANCELLED"] += 1
        else:
            c.violations.append(f"{where}: {state} at the end")
        if rec.seen_end_state and rec.seen_end_state != state:
            c.violations.append(f"{where}: ended {rec.seen_end_state}, {state} now")
        if rec.seen_end_checkpoint and rec.seen_end_checkpoint != job.last_checkpoint:
            c.violations.append(f"{where}: last_checkpoint was {rec.seen_end_checkpoint} when it ended, now "
                                f"{job.last_checkpoint}")
        if job.last_checkpoint:
            why = check_checkpoint(job.last_checkpoint)
            if os.path.dirname(job.last_checkpoint) != own:
                why = why or f"is not in the job's own folder {own}"
            if why:
                missing += 1
                c.violations.append(f"{where}: last_checkpoint {job.last_checkpoint} {why}")
            elif rec.kind == "SFT" and state == "SUCCEEDED" and (
                    not sft_ckpt or (job.restarts > 0 and not sft_restarted)):
                sft_ckpt, sft_restarted = job.last_checkpoint, job.restarts > 0  # one that resumed, if any
            elif rec.kind == "RL" and not rl_ckpt:
                rl_ckpt = job.last_checkpoint
    # An SFT checkpoint learnt the King James text (better than chance, ln 256); an RL session
    # fitted a fixed batch of random bytes (10+ nats/byte on English): a finite loss is all it promises.
    preload.join()
    for path, below in ((sft_ckpt, math.log(256)), (rl_ckpt, math.inf)):
        if path:
            t = time.monotonic()
            loss = load_in_transformers(path, below)
            print(f"transformers loads {path}: loss {loss:.3f} nats/byte ({time.monotonic() - t:.1f} s)", flush=True)

    counts = {k: sum(1 for f in c.faults if f.kind == k)
              for k in (*WORKER_FAULTS, "kill -9 controller")}
    # A worker back from SIGSTOP with a job restarted elsewhere is "stopping" until that run ends
    # (server/controller.h): how often that path ran.
    stopping = c.log("controller").count("came back still holding it; told to stop")
    rl_failed, rl_example = {}, {}
    for r in c.records.values():
        for code, details in r.rl_errors:
            rl_failed[code] = rl_failed.get(code, 0) + 1
            rl_example.setdefault(code, f"{r.name}: {details}")
    print(f"outcomes: {outcomes}; restarts {sum(j.restarts for j in listed.values())} (of RL sessions "
          f"{sum(listed[n].restarts for n, r in c.records.items() if r.kind == 'RL' and n in listed)}); RL rounds "
          f"{sum(r.rl_rounds for r in c.records.values())} (calls failed as faults explain: {rl_failed or 'none'}); "
          f"workers back holding a job told to stop {stopping}; "
          f"cancels {sum(1 for r in c.records.values() if r.cancel == 'done')} (+"
          f"{sum(1 for r in c.records.values() if r.cancel == 'maybe')} unanswered); final jobs on {sorted(ran_on)}; "
          f"controller pids {c.controller_pids}")
    for code, example in sorted(rl_example.items()):
        print(f"  e.g. {code}: {example[:200]}")
    if threads1 > threads0 + THREADS_SLACK:
        c.violations.append(f"controller threads {threads0} -> {threads1} (more than +{THREADS_SLACK})")
    if rss1 > rss0 + RSS_SLACK_MIB:
        c.violations.append(f"controller RSS {rss0:.1f} -> {rss1:.1f} MiB (more than +{RSS_SLACK_MIB} MiB)")
    n_jobs = len(c.records)
    print(f"soak: {n_jobs} jobs ({sum(r.kind == 'SFT' for r in c.records.values())} SFT, "
          f"{sum(r.kind == 'RL' for r in c.records.values())} RL), {len(c.faults)} faults "
          f"({counts['kill -9 worker']} kill -9 worker, {counts['SIGSTOP worker']} SIGSTOP, "
          f"{counts['SIGTERM worker']} SIGTERM, "
          f"{counts['kill -9 controller']} controller kill -9), jobs lost {len(lost)}, checkpoints missing {missing}, "
          f"threads {threads0}->{threads1}, RSS {rss0:.0f}->{rss1:.0f} MiB, {time.monotonic() - t_start:.0f} s",
          flush=True)
    if c.violations:
        raise Failure(f"{len(c.violations)} violation(s) (seed {seed}):\n  " + "\n  ".join(c.violations))


def main():
    ap = arg_parser(cli="the odyssey CLI: the final jobs are submitted with it (empty: through gRPC)")
    ap.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: from the clock, printed)")
    ap.add_argument("--duration", type=float, default=60, help="seconds of load and faults (default 60)")
    args = parse_args(ap)
    if args.seed is None:
        args.seed = int(time.time()) % 100000
    outcome = run_test("soak", "odyssey-soak-", args.keep, lambda workdir: Soak(args, workdir),
                       lambda c: soak(c, args), keep_failed=True)
    return 0 if outcome == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
