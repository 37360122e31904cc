#!/usr/bin/env python3
"""End-to-end tests of the training service with real processes on loopback ports picked at
run time: an odyssey-controller, odyssey-worker daemons (CPU), and the odyssey CLI.

Cases (--case):
  sft              a job submitted through the CLI runs to SUCCEEDED on a CPU worker, its loss
                   falls, its checkpoint loads in transformers (and predicts the text better
                   than chance), and the worker's /metrics counters moved with the work.
  worker_kill      kill -9 of the worker mid-job: a new worker attaches, the job resumes from
                   its last checkpoint (the newest checkpoint event the watch saw; the new
                   worker's log names it; the step count continues) and succeeds.
  controller_kill  kill -9 of the controller mid-job: after a restart on the same state every
                   job and its state is still there, the worker re-attaches, the job finishes.
  data_parallel    a job of world_size 2 runs data parallel on two CPU workers (TCP
                   communicator between the worker processes) and succeeds.
  context_parallel a job of world_size 2 with context_parallel 2 (each rank holds half of every
                   row; Ulysses all-to-alls over the TCP communicator) on two CPU workers gives
                   the one-worker run's losses, step by step (<= 1e-5 relative).
  dp_over_cp       a job of world_size 4 with context_parallel 2 (two data-parallel replicas of
                   context-parallel pairs, a TCP group per pair and per replica rank) on four CPU
                   workers gives the losses of the same job data parallel on two workers.
  hybrid           SFT jobs of hybrid-tiny and hybrid-tiny-moe lower their loss on the King James
                   text like the dense tiny model's (30 steps each, one worker); the indexer's
                   dense warm-up, then the sparse stage from its checkpoint (model.indexer_stage).
  rank_loss        kill -9 of one worker of a 2-rank job: the job restarts from its last
                   checkpoint (the newest the watch saw, and the one both new ranks' logs say
                   they start from) on the surviving and a spare worker and succeeds.
  worker_sigterm   SIGTERM to a worker mid-job: it stops the run between steps, sends its
                   result marked as the worker leaving and exits 0; the job restarts at once
                   from its newest checkpoint on the spare worker and succeeds.
  cancel           `odyssey cancel` stops a running job between steps (CANCELLED); the worker
                   then runs the next job.
  result_while_controller_down
                   a job that ends while the controller is down is reported SUCCEEDED once
                   the controller is back (the worker keeps its result until released).
  shared_checkpoint_folder
                   two runs naming one checkpoint folder (scripts/demo.sh run twice): CreateJob
                   refuses the folder while the first run is live; a run of a new store (job
                   ids start again at jobs/1) fails at its start naming the folder, and the
                   first run's checkpoint is still there.
  resume_from_spec a new job with spec.resume_from = another job's step-4 checkpoint starts at
                   step 5 with the uninterrupted run's losses at steps 5..8; `odyssey get` shows
                   resume_from; a resume_from that is no folder is refused naming the field.

Every wait is on a condition with a deadline; nothing sleeps and hopes.
"""
import glob
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (DEADLINE_S, Failure, Processes, arg_parser, expect_rpc_error, free_port_base,  # noqa: E402
                     generate_stubs, parse_args, run_test, scrape, wait_for, wait_for_port_file)


class Cluster(Processes):
    def __init__(self, args, workdir):
        super().__init__(workdir)
        self.args = args
        self.state_dir = os.path.join(workdir, "state")
        self.controller = None
        self.port = 0
        self.workers = {}
        self.grpc, self.pb, self.pbg = generate_stubs(args.source_dir, workdir)

    def start_controller(self, extra=()):
        """Starts (or restarts, on the same port and state) the controller; `extra`: more flags."""
        port_file = os.path.join(self.workdir, "controller.port")
        if os.path.exists(port_file):
            os.remove(port_file)
        listen = f"127.0.0.1:{self.port}"
        if not hasattr(self, "rendezvous_base"):
            self.rendezvous_base = free_port_base()
        self.controller = self.spawn("controller", [
            self.args.controller, "--listen", listen, "--port-file", port_file, "--state-dir", self.state_dir,
            "--metrics-listen", "127.0.0.1:0", "--heartbeat-timeout", "4",
            "--rendezvous-port-base", str(self.rendezvous_base), *extra])
        self.port = wait_for_port_file(port_file, "the controller's port file")
        self.address = f"127.0.0.1:{self.port}"
        self.channel = self.grpc.insecure_channel(self.address)
        self.jobs = self.pbg.JobServiceStub(self.channel)

    def kill_controller(self):
        self.controller.send_signal(signal.SIGKILL)
        self.controller.wait()
        self.channel.close()

    def start_worker(self, worker_id):
        port_file = os.path.join(self.workdir, f"{worker_id}.metrics-port")
        p = self.spawn(worker_id, [
            self.args.worker, "--controller", self.address, "--worker-id", worker_id, "--device", "cpu",
            "--threads", "1", "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", port_file,
            "--heartbeat-interval", "0.5", "--max-backoff", "0.5", "--progress-interval", "0"])
        self.workers[worker_id] = p
        return wait_for_port_file(port_file, f"{worker_id}'s metrics port")

    def kill_worker(self, worker_id):
        p = self.workers.pop(worker_id)
        p.send_signal(signal.SIGKILL)
        p.wait()

    def get(self, name):
        return self.jobs.GetJob(self.pb.GetJobRequest(name=name), timeout=10)

    def submit(self, spec_dict):
        """Submits through the CLI when there is one, else through gRPC; returns the job name."""
        spec_path = os.path.join(self.workdir, f"spec-{time.monotonic_ns()}.json")
        with open(spec_path, "w") as f:
            json.dump(spec_dict, f)
        if self.args.cli:
            out = subprocess.run([self.args.cli, "--controller", self.address, "submit", spec_path],
                                 capture_output=True, text=True, timeout=60)
            if out.returncode != 0:
                raise Failure(f"odyssey submit failed ({out.returncode}): {out.stdout}{out.stderr}")
            m = re.search(r"jobs/\d+", out.stdout)
            if not m:
                raise Failure(f"odyssey submit printed no job name: {out.stdout!r}")
            return m.group(0)
        from google.protobuf import json_format
        spec = json_format.ParseDict(spec_dict, self.pb.JobSpec())
        return self.jobs.CreateJob(self.pb.CreateJobRequest(spec=spec), timeout=10).name

    def state_of(self, name):
        try:
            return self.pb.Job.State.Name(self.get(name).state)
        except self.grpc.RpcError:
            return None  # controller not serving (yet)

    def wait_state(self, name, state, timeout=DEADLINE_S):
        def check():
            s = self.state_of(name)
            if s in ("FAILED", "CANCELLED") and s != state:
                raise Failure(f"{name} ended {s}: {self.get(name).error}")
            return s == state
        wait_for(f"{name} to be {state}", check, timeout)
        return self.get(name)

    def watch(self, name, events=None, phases=None):
        """Collects the job's step events on a background thread; returns the list it fills.
        `events`, when given, is a list ("checkpoint", directory) and ("state", name) events are
        appended to, in the order the controller committed them; `phases`, a dict that gets each
        step's phase times ({step: {phase: (count, seconds)}}) where the step event has them."""
        steps = []

        def run():
            try:
                for ev in self.jobs.WatchJob(self.pb.WatchJobRequest(name=name), timeout=DEADLINE_S):
                    if ev.WhichOneof("event") == "step":
                        if phases is not None and ev.step.phases:
                            phases[ev.step.step] = {p.phase: (p.count, p.seconds) for p in ev.step.phases}
                        steps.append((ev.step.step, ev.step.loss))
                    elif ev.WhichOneof("event") == "checkpoint" and events is not None:
                        events.append(("checkpoint", ev.checkpoint))
                    elif ev.WhichOneof("event") == "state" and events is not None:
                        events.append(("state", self.pb.Job.State.Name(ev.state)))
            except self.grpc.RpcError:
                pass  # the controller went away; the test decides what that means

        threading.Thread(target=run, daemon=True).start()
        return steps


def requeued(c, name):
    """True once job `name` was restarted once; raises if it ended instead."""
    job = c.get(name)
    if c.pb.Job.State.Name(job.state) in ("FAILED", "CANCELLED"):
        raise Failure(f"{name} ended {c.pb.Job.State.Name(job.state)} instead of restarting: {job.error}")
    return job.restarts == 1


def step_of(checkpoint):
    return int(re.search(r"step-(\d+)", checkpoint).group(1))


def recorded_events(c, name):
    """The job's ("checkpoint", directory) and ("state", name) events as the controller recorded
    them, oldest first (ListJobEvents: the whole history, where a watch sees only what follows
    its subscription and the current state)."""
    out, token = [], ""
    while True:
        page = c.jobs.ListJobEvents(c.pb.ListJobEventsRequest(name=name, page_token=token), timeout=30)
        for ev in page.events:
            if ev.WhichOneof("event") == "checkpoint":
                out.append(("checkpoint", ev.checkpoint))
            elif ev.WhichOneof("event") == "state":
                out.append(("state", c.pb.Job.State.Name(ev.state)))
        token = page.next_page_token
        if not token:
            return out


def check_resumed_from_newest(c, name, events, workers):
    """The requeued job's resume point is the newest checkpoint the workers reported before the
    requeue (the checkpoint events the controller recorded, not its own last_checkpoint field),
    and each of `workers` logs that it starts from it. Returns that checkpoint's step."""
    # The watch (`events`) shows the requeue; the recorded history, in commit order, every
    # checkpoint reported before it (a watch subscribed after a checkpoint does not see it: under
    # load the job can pass its first checkpoints before the watch's stream opens).
    wait_for("the watch to see the requeue", lambda: ("state", "PENDING") in events)
    history = recorded_events(c, name)
    # The requeue: the first PENDING after the job first ran (the history opens with its creation's).
    running = history.index(("state", "RUNNING")) if ("state", "RUNNING") in history else len(history)
    if ("state", "PENDING") not in history[running:]:
        raise Failure(f"the recorded events of {name} have no requeue (PENDING after RUNNING): {history}")
    before = history[:history.index(("state", "PENDING"), running)]
    checkpoints = [v for k, v in before if k == "checkpoint"]
    if len(checkpoints) < 2:
        raise Failure(f"want 2+ checkpoints before the loss (a stale one must be telling): {checkpoints}")
    newest = max(checkpoints, key=step_of)
    ckpt = c.get(name).last_checkpoint
    print(f"checkpoint events: {[step_of(x) for x in checkpoints]}; the job resumes from {ckpt}")
    if ckpt != newest:
        raise Failure(f"the job resumes from {ckpt}, not the newest checkpoint reported ({newest})")
    for w in workers:
        wait_for(f"{w} to start {name} from {newest}", lambda: f"starting from {newest}" in c.log(w))
    return step_of(newest)


def tiny_spec(steps, every):
    return {
        "kind": "SFT",
        "displayName": "e2e",
        "model": {"name": "tiny", "dtype": "float32"},
        "optimizer": {"lr": 3e-3, "warmupSteps": 5, "gradClip": 1.0},
        "data": {"format": "kjv", "seqLen": 32, "batchSize": 4, "seed": 1},
        "steps": str(steps),
        "checkpoint": {"everySteps": str(every), "keep": 2},
        "restartLimit": 2,
    }


def case_sft(c):
    if not c.args.cli:
        raise Failure("the sft case submits through the odyssey CLI: pass --cli")
    c.start_controller()
    metrics_port = c.start_worker("w1")
    before = scrape(metrics_port)
    name = c.submit(tiny_spec(steps=60, every=20))
    steps = c.watch(name)
    job = c.wait_state(name, "SUCCEEDED")
    print(f"{name}: SUCCEEDED at step {job.step}, loss {job.loss:.3f}, checkpoint {job.last_checkpoint}")
    if job.step != 60:
        raise Failure(f"step {job.step}, want 60")
    # The loss falls: from chance (ln 256 = 5.55 nats/byte at init) to clearly below it.
    wait_for("the final step event", lambda: steps and steps[-1][0] == 60, timeout=30)
    # The watch may start after the first steps on a busy machine: without step 1, the start is
    # chance (a fresh model predicts bytes uniformly: ln 256).
    first_step, first_loss = steps[0] if steps[0][0] == 1 else (0, math.log(256))
    print(f"loss {first_loss:.3f} (step {first_step}) -> {job.loss:.3f} (step 60)")
    if not job.loss < first_loss - 1.0 or not job.loss < math.log(256) - 1.5:
        raise Failure(f"loss did not fall: {first_loss} -> {job.loss}")
    # The checkpoint loads in transformers and predicts King James text better than chance.
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(job.last_checkpoint, torch_dtype=torch.float32)
    text = b"In the beginning God created the heaven and the earth. And the earth was without form, and void."
    ids = torch.tensor([list(text)])
    with torch.no_grad():
        hf_loss = model(input_ids=ids, labels=ids).loss.item()
    print(f"transformers loads {job.last_checkpoint}: loss on Genesis 1:1-2 = {hf_loss:.3f} nats/byte")
    if not hf_loss < math.log(256) - 1.0:
        raise Failure(f"the checkpoint predicts no better than chance: {hf_loss}")
    # The worker's /metrics moved with the work done (its own names: odyssey_worker_*).
    after = scrape(metrics_port)
    tokens = after["odyssey_worker_tokens_total"] - before.get("odyssey_worker_tokens_total", 0)
    if tokens != 60 * 4 * 32:
        raise Failure(f"odyssey_worker_tokens_total grew by {tokens}, want {60 * 4 * 32}")
    if after['odyssey_worker_jobs_total{result="succeeded"}'] != 1:
        raise Failure("odyssey_worker_jobs_total{result=succeeded} is not 1")
    if after["odyssey_worker_step_duration_seconds_count"] != 60:
        raise Failure(f"odyssey_worker_step_duration_seconds_count is "
                      f"{after['odyssey_worker_step_duration_seconds_count']}")


def case_worker_kill(c):
    c.start_controller()
    c.start_worker("w1")
    name = c.submit(tiny_spec(steps=300, every=20))
    events = []
    steps = c.watch(name, events)
    # Two checkpoints at least, so that resuming from a stale one cannot pass for the last.
    job = wait_for("a checkpoint at step >= 40",
                   lambda: (lambda j: j if j.last_checkpoint and j.step >= 40 else None)(c.get(name)))
    c.kill_worker("w1")
    killed_at = c.get(name).step
    # Once the controller has declared w1 dead and queued the job again, the checkpoint it will
    # resume from is settled (w1's last messages were read before its stream's end).
    wait_for("the controller to requeue the job", lambda: requeued(c, name))
    print(f"killed w1 at step ~{killed_at}")
    w2_metrics = c.start_worker("w2")
    ckpt_step = check_resumed_from_newest(c, name, events, ["w2"])
    job = c.wait_state(name, "SUCCEEDED")
    print(f"{name}: SUCCEEDED at step {job.step} on {list(job.workers)} after {job.restarts} restart(s)")
    if job.step != 300 or job.restarts != 1 or list(job.workers) != ["w2"]:
        raise Failure(f"step {job.step}, restarts {job.restarts}, workers {list(job.workers)}")
    # The resumed run continues from the checkpoint instead of starting over: w2 ran exactly the
    # steps after it, and the step events only ever go back to the step after the checkpoint.
    w2_steps = scrape(w2_metrics)["odyssey_steps_total"]
    print(f"w2 ran {w2_steps:.0f} steps (300 - checkpoint step {ckpt_step} = {300 - ckpt_step})")
    if w2_steps != 300 - ckpt_step:
        raise Failure(f"w2 ran {w2_steps} steps, want {300 - ckpt_step}")
    wait_for("the final step event", lambda: steps and steps[-1][0] == 300, timeout=30)
    seq = [s for s, _ in steps]
    drops = [(a, b) for a, b in zip(seq, seq[1:]) if b <= a]
    print(f"step events: {len(seq)}, where the count went back: {drops}")
    if any(b != ckpt_step + 1 for _, b in drops) or len(drops) > 1:
        raise Failure(f"the step count went back to something other than {ckpt_step + 1}: {drops}")


def case_controller_kill(c):
    c.start_controller()
    metrics_port = c.start_worker("w1")
    short = c.submit(tiny_spec(steps=10, every=0))
    c.wait_state(short, "SUCCEEDED")
    name = c.submit(tiny_spec(steps=300, every=20))
    wait_for("the long job to pass step 20", lambda: c.get(name).step >= 20)
    before = {j.name: (j.state, j.step) for j in c.jobs.ListJobs(c.pb.ListJobsRequest(), timeout=10).jobs}
    c.kill_controller()
    print(f"killed the controller; jobs were {before}")
    c.start_controller()
    after = {j.name: j for j in c.jobs.ListJobs(c.pb.ListJobsRequest(), timeout=10).jobs}
    if set(after) != set(before):
        raise Failure(f"jobs after restart {sorted(after)} != before {sorted(before)}")
    if c.pb.Job.State.Name(after[short].state) != "SUCCEEDED" or after[short].step != 10:
        raise Failure(f"{short} after restart: {after[short]}")
    if c.pb.Job.State.Name(after[name].state) not in ("RUNNING", "SUCCEEDED") or after[name].step < before[name][1]:
        raise Failure(f"{name} after restart: state {after[name].state}, step {after[name].step}")
    wait_for("w1 to re-attach", lambda: scrape(metrics_port).get("odyssey_worker_reconnects_total", 0) >= 1
             and scrape(metrics_port).get("odyssey_worker_connected") == 1)
    job = c.wait_state(name, "SUCCEEDED")
    print(f"{name}: SUCCEEDED at step {job.step} on {list(job.workers)}, restarts {job.restarts}")
    if job.step != 300 or job.restarts != 0:
        raise Failure(f"step {job.step}, restarts {job.restarts}: the job should not have been restarted")


def case_data_parallel(c):
    """A job of world_size 2 on two CPU workers: the ranks meet at the rendezvous the controller
    hands out (TCP communicator), both run every step, and the job succeeds. Another process
    holds the port of the job's first attempt (--rendezvous-port-base + 1): rank 0 cannot listen
    there, the ranks do not meet, and the controller runs the job again on another port (one
    rendezvous retry, no restart)."""
    c.start_controller()
    m1 = c.start_worker("w1")
    m2 = c.start_worker("w2")
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", c.rendezvous_base + 1))  # jobs/1's first port (free_port_base: free)
    squatter.listen(1)
    try:
        spec = tiny_spec(steps=30, every=10)
        spec["parallel"] = {"world_size": 2}
        name = c.submit(spec)
        if name != "jobs/1":
            raise Failure(f"the first job of a fresh controller is {name}, not jobs/1")
        job = c.wait_state(name, "SUCCEEDED")
    finally:
        squatter.close()
    print(f"{name}: SUCCEEDED at step {job.step} on {list(job.workers)}, loss {job.loss:.3f}, "
          f"rendezvous retries {job.rendezvous_retries}, restarts {job.restarts}")
    if job.step != 30 or sorted(job.workers) != ["w1", "w2"]:
        raise Failure(f"step {job.step}, workers {list(job.workers)}")
    if job.rendezvous_retries != 1 or job.restarts != 0:
        raise Failure(f"rendezvous retries {job.rendezvous_retries}, restarts {job.restarts}: the taken port "
                      "should have cost one rendezvous retry and no restart")
    for wid, port in (("w1", m1), ("w2", m2)):
        m = scrape(port)
        print(f"{wid}: {m['odyssey_steps_total']:.0f} steps, {m['odyssey_worker_tokens_total']:.0f} tokens")
        if m["odyssey_steps_total"] != 30 or m["odyssey_worker_tokens_total"] != 30 * 4 * 32:
            raise Failure(f"{wid} ran {m['odyssey_steps_total']} steps / {m['odyssey_worker_tokens_total']} tokens")


def run_step_losses(c, spec, workers, what):
    """Runs `spec` to SUCCEEDED on `workers` (all of them; None: any) and returns its per-step
    losses as a watch saw them ({step: loss}); the final step's event must arrive."""
    name = c.submit(spec)
    seen = c.watch(name)
    job = c.wait_state(name, "SUCCEEDED")
    steps = int(spec["steps"])
    if job.step != steps or (workers is not None and sorted(job.workers) != sorted(workers)):
        raise Failure(f"{name} ({what}): step {job.step}, workers {list(job.workers)}")
    # A watch opened after the first steps sees the latest one first, then every later one.
    wait_for(f"the {what} run's final step event", lambda: seen and seen[-1][0] == steps, timeout=30)
    return dict(seen)


def expect_same_losses(want, got, want_what, what, bar=1e-5):
    """The steps both watches saw (at least 5) have losses within `bar` relative."""
    common = sorted(set(want) & set(got))
    print(f"{what}: steps seen by both watches: {common}")
    for s in common:
        print(f"step {s}: {want_what} {want[s]:.9f}, {what} {got[s]:.9f}")
    if len(common) < 5:
        raise Failure(f"only steps {common} were seen by both watches ({what})")
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in common)
    print(f"{what}: largest relative difference {worst:.2e}")
    if worst > bar:
        raise Failure(f"{what} losses differ from the {want_what} run's by {worst:.2e} (relative)")


def case_context_parallel(c):
    """An SFT job of world_size 2 and context_parallel 2 on two CPU workers: both ranks train on
    the same batches, each on half of every row, and the per-step losses equal those of the same
    job on one worker (fp32; the ranks sum the same terms in another order: 1e-5 relative); so do
    those of the same job with parallel.shard_params (ZeRO-3 over the pair), and those of a
    hybrid-tiny job (KDA and DSA layers) at context_parallel 2, unsharded and sharded."""
    c.start_controller()
    c.start_worker("w1")
    c.start_worker("w2")
    spec = tiny_spec(steps=8, every=0)
    one_loss = run_step_losses(c, spec, None, "one worker")

    def run_matches_one_worker(parallel, what, log_pattern):
        """Runs `spec` with `parallel` on w1 and w2; its per-step losses must equal the one-worker
        run's and both workers' logs must show a rank of it."""
        spec["parallel"] = parallel
        expect_same_losses(one_loss, run_step_losses(c, spec, ["w1", "w2"], what), "one worker", what)
        for w in ("w1", "w2"):
            if not re.search(log_pattern, c.log(w)):
                raise Failure(f"{w}'s log does not show a rank of the {what} run")

    run_matches_one_worker({"world_size": 2, "contextParallel": 2}, "context parallel",
                           r"rank=[01]/2 context_parallel=2 model")
    # The same job with its parameters, gradients and AdamW state sharded over the two ranks
    # (ZeRO-3): the same losses again.
    run_matches_one_worker({"world_size": 2, "contextParallel": 2, "shardParams": True}, "sharded",
                           r"rank=[01]/2 context_parallel=2 shard_params=2 model")
    # The hybrid family: its KDA and DSA layers split their heads over the pair, the sequence's
    # tiles broadcast by the rank that holds them (model/hybrid.h); the indexer's KL trains.
    spec = tiny_spec(steps=8, every=0)
    spec["model"]["name"] = "hybrid-tiny"
    spec["data"]["seqLen"] = 64
    one_hybrid = run_step_losses(c, spec, None, "hybrid-tiny on one worker")
    spec["parallel"] = {"world_size": 2, "contextParallel": 2}
    expect_same_losses(one_hybrid, run_step_losses(c, spec, ["w1", "w2"], "hybrid-tiny context parallel"),
                       "one worker", "hybrid-tiny context parallel")
    # And sharded over the pair (a KDA layer's fp32 A_log and dt_bias travel beside its weights).
    spec["parallel"] = {"world_size": 2, "contextParallel": 2, "shardParams": True}
    expect_same_losses(one_hybrid, run_step_losses(c, spec, ["w1", "w2"], "hybrid-tiny sharded"), "one worker",
                       "hybrid-tiny sharded")


def case_dp_over_cp(c):
    """An SFT job of world_size 4 and context_parallel 2 on four CPU workers (two data-parallel
    replicas of context-parallel pairs, each pair with a TCP group of its own) gives the per-step
    losses of the same job data parallel on two workers (each replica reads the batches of the
    data rank it is; 1e-5 relative), and every worker's log shows its two groups."""
    c.start_controller()
    workers = ["w1", "w2", "w3", "w4"]
    for w in workers:
        c.start_worker(w)
    spec = tiny_spec(steps=8, every=0)
    spec["parallel"] = {"world_size": 2}
    dp_loss = run_step_losses(c, spec, None, "data parallel")
    spec["parallel"] = {"world_size": 4, "contextParallel": 2}
    expect_same_losses(dp_loss, run_step_losses(c, spec, workers, "2 x context parallel 2"), "data parallel",
                       "2 x context parallel 2")
    for w in workers:
        if not re.search(r"rank=[0-3]/4 context group of 2 over tcp \(.*\), data group of 2 over tcp", c.log(w)):
            raise Failure(f"{w}'s log does not show its context and data groups")
        if not re.search(r"rank=[0-3]/4 context_parallel=2 data_parallel=2 model", c.log(w)):
            raise Failure(f"{w}'s log does not show a rank of the 2 x context parallel 2 run")


def case_hybrid(c):
    """The hybrid family through the service: SFT jobs of hybrid-tiny (KDA and DSA layers) and
    hybrid-tiny-moe (with MoE MLPs) on the King James text lower their loss like the dense tiny
    model's on the same data (each drops by more than 0.8 nats over 30 steps, and by at least
    half the dense model's drop), and the worker's log names the model."""
    c.start_controller()
    metrics_port = c.start_worker("w1")
    drops = {}
    for model in ("tiny", "hybrid-tiny", "hybrid-tiny-moe"):
        spec = tiny_spec(steps=30, every=0)
        spec["model"]["name"] = model
        spec["data"]["seqLen"] = 64
        spec["optimizer"] = {"lr": 1e-2, "warmupSteps": 2, "gradClip": 1.0}
        losses = run_step_losses(c, spec, ["w1"], model)
        first, last = min(losses), max(losses)
        # The first step a watch saw may be a few in; the mean of the first and last three seen
        # steps smooths the batch-to-batch noise.
        head = [losses[s] for s in sorted(losses)[:3]]
        tail = [losses[s] for s in sorted(losses)[-3:]]
        drops[model] = sum(head) / len(head) - sum(tail) / len(tail)
        print(f"{model}: steps {first}..{last} seen, loss {head[0]:.3f} -> {tail[-1]:.3f} (drop {drops[model]:.3f})")
        if last != 30 or first > 3:
            raise Failure(f"{model}: the watch saw steps {first}..{last}, want from the first few to 30")
        if not re.search(rf"model {re.escape(model)} \(", c.log("w1")):
            raise Failure(f"the worker's log does not name the model {model}")
    for model in ("hybrid-tiny", "hybrid-tiny-moe"):
        if drops[model] < 0.8 or drops[model] < 0.5 * drops["tiny"]:
            raise Failure(f"{model}'s loss fell by {drops[model]:.3f}, the dense tiny model's by {drops['tiny']:.3f}")
    # spec.profile.phase_times: each step event carries the step's phase times, and the worker
    # exports the last step's as odyssey_worker_phase_seconds{phase}.
    spec = tiny_spec(steps=3, every=0)
    spec["model"]["name"] = "hybrid-tiny"
    spec["data"]["seqLen"] = 64
    spec["profile"] = {"phaseTimes": True, "traceStep": "2"}
    name = c.submit(spec)
    phases = {}
    seen = c.watch(name, phases=phases)
    job = c.wait_state(name, "SUCCEEDED")
    # spec.profile.trace_step: step 2's Chrome trace beside the job's checkpoints, under its name.
    # (The file is named after the checkpoint owner, the controller's id and the job's name.)
    found = glob.glob(os.path.join(os.path.dirname(job.last_checkpoint), "profile",
                                   "*-" + name.replace("/", "-") + "-step-00000002.trace.json"))
    if len(found) != 1 or '"traceEvents"' not in open(found[0]).read():
        raise Failure(f"{name}: no one Chrome trace of step 2 beside {job.last_checkpoint}: {found}")
    trace = found[0]
    print(f"{name}: step 2's trace {trace} ({os.path.getsize(trace)} bytes)")
    wait_for("the phase-timed run's final step event", lambda: seen and seen[-1][0] == 3, timeout=30)
    last = phases.get(3)
    if not last:
        raise Failure(f"{name}: the final step event has no phase times (steps with them: {sorted(phases)})")
    layers = last.get("layer # forward", (0, 0))[0]
    kernels = [p for p in last if p.startswith("kda ") or p.startswith("dsa ")]
    print(f"{name}: step 3's phases: {len(last)} kinds, layer # forward x{layers}, kernel phases {sorted(kernels)}")
    if layers != 4 or not any(p.startswith("kda ") for p in kernels) or not any(p.startswith("dsa ") for p in kernels):
        raise Failure(f"{name}: step 3's phases {last} lack the 4 layers' forwards or the KDA and DSA phases")
    for phase in ("loss", "optimizer", "backward"):
        if last.get(phase, (0, 0))[1] <= 0:
            raise Failure(f"{name}: step 3's phase {phase!r} has no time: {last}")
    exported = scrape(metrics_port)
    key = 'odyssey_worker_phase_seconds{phase="optimizer"}'
    if exported.get(key, 0) <= 0:
        raise Failure(f"the worker's /metrics has no {key}: "
                      f"{sorted(k for k in exported if 'phase' in k)}")
    # The indexer's dense warm-up (spec.model.indexer_stage on a named shape whose config says
    # sparse; only the indexers train), then the sparse stage from the warm-up's checkpoint folder
    # without editing it; each checkpoint's config.json names the stage its job ran.
    def stage_of(folder):
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f).get("indexer_stage")

    spec = tiny_spec(steps=3, every=0)
    spec["model"] = {"name": "hybrid-tiny", "dtype": "float32", "indexerStage": "dense_warmup"}
    spec["data"]["seqLen"] = 64
    warm = c.wait_state(c.submit(spec), "SUCCEEDED")
    spec["model"] = {"name": warm.last_checkpoint, "dtype": "float32", "indexerStage": "sparse"}
    sparse = c.wait_state(c.submit(spec), "SUCCEEDED")
    stages = (stage_of(warm.last_checkpoint), stage_of(sparse.last_checkpoint))
    print(f"warm-up then sparse: checkpoints {warm.last_checkpoint} ({stages[0]}), {sparse.last_checkpoint} "
          f"({stages[1]})")
    if stages != ("dense_warmup", "sparse"):
        raise Failure(f"the warm-up's and the sparse job's checkpoints name the stages {stages}")
    trained = re.findall(r"indexer stage (\w+), ([0-9.]+)M trained", c.log("w1"))
    if ("dense_warmup", "sparse") != tuple(s for s, _ in trained[-2:]) or \
            not float(trained[-2][1]) < float(trained[-1][1]):
        raise Failure(f"the worker's log does not show the warm-up training fewer weights than the sparse job: "
                      f"{trained[-2:]}")


def case_rank_loss(c):
    """kill -9 of one worker of a 2-rank job: the surviving rank stops on the controller's
    cancel instead of failing the job, and the job restarts from its last checkpoint on the
    survivor and a spare worker, and succeeds."""
    c.start_controller()
    for w in ("w1", "w2", "w3"):
        c.start_worker(w)
    spec = tiny_spec(steps=200, every=20)
    spec["parallel"] = {"world_size": 2}
    name = c.submit(spec)
    events = []
    steps = c.watch(name, events)
    job = wait_for("a checkpoint at step >= 40",
                   lambda: (lambda j: j if j.last_checkpoint and j.step >= 40 else None)(c.get(name)))
    victim = job.workers[1]
    c.kill_worker(victim)
    wait_for("the controller to requeue the job", lambda: requeued(c, name))
    print(f"killed {victim} (rank 1) at step ~{job.step}")
    job = wait_for(f"{name} to be placed again", lambda: (lambda j: j if len(j.workers) == 2 and victim not in j.workers
                                                          else None)(c.get(name)))
    ckpt_step = check_resumed_from_newest(c, name, events, list(job.workers))
    job = c.wait_state(name, "SUCCEEDED")
    print(f"{name}: SUCCEEDED at step {job.step} on {list(job.workers)} after {job.restarts} restart(s)")
    if job.step != 200 or job.restarts != 1 or victim in job.workers or len(job.workers) != 2:
        raise Failure(f"step {job.step}, restarts {job.restarts}, workers {list(job.workers)}")
    # Not a restart from scratch: after the loss the step count goes back only to the step after
    # the checkpoint.
    wait_for("the final step event", lambda: steps and steps[-1][0] == 200, timeout=30)
    seq = [s for s, _ in steps]
    drops = [(a, b) for a, b in zip(seq, seq[1:]) if b <= a]
    print(f"step events: {len(seq)}, where the count went back: {drops}")
    if len(drops) > 1 or any(b != ckpt_step + 1 for _, b in drops):
        raise Failure(f"the step count went back to something other than {ckpt_step + 1}: {drops}")


def case_cancel(c):
    """odyssey cancel stops a running job between steps; the worker then takes the next job."""
    c.start_controller()
    metrics_port = c.start_worker("w1")
    name = c.submit(tiny_spec(steps=100000, every=0))
    wait_for(f"{name} to pass step 5", lambda: c.get(name).step >= 5)
    out = subprocess.run([c.args.cli, "--controller", c.address, "cancel", name], capture_output=True, text=True,
                         timeout=60)
    if out.returncode != 0:
        raise Failure(f"odyssey cancel failed ({out.returncode}): {out.stdout}{out.stderr}")
    c.wait_state(name, "CANCELLED")
    wait_for("w1 to report the cancelled run",
             lambda: scrape(metrics_port).get('odyssey_worker_jobs_total{result="cancelled"}') == 1, timeout=30)
    follow = c.submit(tiny_spec(steps=5, every=0))
    c.wait_state(follow, "SUCCEEDED")
    print(f"{name} CANCELLED; {follow} then SUCCEEDED on the same worker")


def case_result_while_controller_down(c):
    """A job that ends while the controller is down: its result is kept by the worker and
    delivered after the controller comes back."""
    c.start_controller()
    metrics_port = c.start_worker("w1")
    name = c.submit(tiny_spec(steps=80, every=20))
    wait_for(f"{name} to pass step 5", lambda: c.get(name).step >= 5)
    c.kill_controller()
    wait_for("the job to end on w1 with the controller down",
             lambda: scrape(metrics_port).get('odyssey_worker_jobs_total{result="succeeded"}') == 1)
    c.start_controller()
    job = c.wait_state(name, "SUCCEEDED")
    print(f"{name}: SUCCEEDED at step {job.step} (ended while the controller was down), restarts {job.restarts}")
    if job.step != 80 or job.restarts != 0 or not job.last_checkpoint.endswith("step-00000080"):
        raise Failure(f"step {job.step}, restarts {job.restarts}, checkpoint {job.last_checkpoint}")


def case_shared_checkpoint_folder(c):
    """A checkpoint folder belongs to one job: no second run writes, prunes or replaces its steps."""
    from google.protobuf import json_format
    folder = os.path.join(c.workdir, "shared-ckpt")
    c.start_controller()
    c.start_worker("w1")
    spec = tiny_spec(steps=100000, every=5)
    spec["checkpoint"].update({"directory": folder, "keep": 1})
    first = c.submit(spec)
    wait_for(f"{first}'s first checkpoint", lambda: c.get(first).last_checkpoint != "")
    again = tiny_spec(steps=10, every=5)
    again["checkpoint"].update({"directory": folder + "/", "keep": 1})
    try:
        c.jobs.CreateJob(c.pb.CreateJobRequest(spec=json_format.ParseDict(again, c.pb.JobSpec())), timeout=10)
        raise Failure(f"CreateJob accepted {folder}/ while {first} writes there")
    except c.grpc.RpcError as e:
        if e.code() != c.grpc.StatusCode.FAILED_PRECONDITION or f"is in use by {first} (RUNNING)" not in e.details():
            raise Failure(f"CreateJob on a live job's folder: {e.code()} {e.details()}")
    c.jobs.CancelJob(c.pb.CancelJobRequest(name=first), timeout=10)
    c.wait_state(first, "CANCELLED")
    kept = c.get(first).last_checkpoint
    steps_before = sorted(os.listdir(folder))
    # A new store and a new worker, as scripts/demo.sh starts each time: its first job is jobs/1
    # again. (A new worker: w1 may still hold the old jobs/1's unreleased result, which a
    # controller of another store cannot tell from its own jobs/1.)
    c.kill_worker("w1")
    c.kill_controller()
    c.state_dir = os.path.join(c.workdir, "state-2")
    c.start_controller()
    c.start_worker("w2")
    second = c.submit(again)
    if second != first:
        raise Failure(f"the new store's first job is {second}, expected {first} (ids start over)")
    wait_for(f"{second} of the new store to fail", lambda: c.state_of(second) == "FAILED")
    error = c.get(second).error
    if f'checkpoint folder "{folder}/" holds step-' not in error or "of another job" not in error:
        raise Failure(f"{second} failed with {error!r}")
    if c.get(second).step != 0:
        raise Failure(f"{second} trained {c.get(second).step} steps before refusing")
    if sorted(os.listdir(folder)) != steps_before or not os.path.exists(os.path.join(kept, "model.safetensors")):
        raise Failure(f"{folder} changed: {steps_before} -> {sorted(os.listdir(folder))}; {kept} must remain")
    print(f"{first}'s folder refused while live, then {second} of a new store failed at its start: {error}")


def case_resume_from_spec(c):
    """A new job whose spec names another job's step-4 checkpoint in resume_from: it starts at
    step 5 and its losses at steps 5..8 are those of the job that ran 1..8 uninterrupted; the CLI
    shows resume_from; a folder that is no checkpoint is refused at CreateJob naming the field."""
    c.start_controller()
    c.start_worker("w1")
    first_spec = tiny_spec(steps=8, every=2)
    first_spec["checkpoint"]["keep"] = 0
    first = c.submit(first_spec)
    first_steps = c.watch(first)
    job = c.wait_state(first, "SUCCEEDED")
    wait_for(f"{first}'s step events 5..8", lambda: {5, 6, 7, 8} <= {s for s, _ in first_steps}, timeout=30)
    checkpoint = re.sub(r"step-\d+$", "step-00000004", job.last_checkpoint)
    spec = tiny_spec(steps=8, every=2)
    spec["resumeFrom"] = checkpoint
    second = c.submit(spec)
    second_steps = c.watch(second)
    c.wait_state(second, "SUCCEEDED")
    wait_for(f"{second}'s step events 5..8", lambda: {5, 6, 7, 8} <= {s for s, _ in second_steps}, timeout=30)
    a, b = dict(first_steps), dict(second_steps)
    print(f"{first} losses 5..8: {[a[s] for s in range(5, 9)]}")
    print(f"{second} (resume_from {checkpoint}) losses: {sorted(b.items())}")
    if min(b) != 5:
        raise Failure(f"{second} started at step {min(b)}, want 5")
    if any(a[s] != b[s] for s in range(5, 9)):
        raise Failure(f"resumed losses differ from the uninterrupted run's: {a} vs {b}")
    if c.args.cli:
        out = subprocess.run([c.args.cli, "--controller", c.address, "get", second], capture_output=True, text=True,
                             timeout=60)
        if f"resume_from:     {checkpoint}" not in out.stdout:
            raise Failure(f"odyssey get does not show resume_from: {out.stdout}")
    bad = tiny_spec(steps=8, every=2)
    bad["resumeFrom"] = os.path.join(c.workdir, "no-such-checkpoint")
    from google.protobuf import json_format
    expect_rpc_error("CreateJob with a resume_from that is no folder", lambda: c.jobs.CreateJob(
        c.pb.CreateJobRequest(spec=json_format.ParseDict(bad, c.pb.JobSpec())), timeout=10),
        c.grpc.StatusCode.INVALID_ARGUMENT, "spec.resume_from", "is not a folder")


def case_worker_sigterm(c):
    """SIGTERM to a worker mid-job (a pod deleted, a node drained): the run stops between steps,
    its result reaches the controller before the process exits 0, marked as the worker leaving;
    the job is not at fault, so it restarts at once (not after the heartbeat timeout) from its
    newest checkpoint on the spare worker and succeeds, one restart counted."""
    c.start_controller()
    c.start_worker("w1")
    spec = tiny_spec(steps=300, every=20)
    name = c.submit(spec)
    events = []
    steps = c.watch(name, events)
    wait_for(f"{name} to pass a second checkpoint on w1",
             lambda: (lambda j: list(j.workers) == ["w1"] and j.last_checkpoint and step_of(j.last_checkpoint) >= 40)(
                 c.get(name)))
    c.start_worker("w2")
    p = c.workers.pop("w1")
    p.send_signal(signal.SIGTERM)
    try:
        rc = p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise Failure("the worker did not exit within 60 s of SIGTERM")
    if rc != 0:
        raise Failure(f"the worker exited {rc} after SIGTERM, want 0")
    if "signal 15: stopping" not in c.log("w1"):
        raise Failure("the worker's log does not show the SIGTERM")
    wait_for("the controller to requeue the job", lambda: requeued(c, name))
    # Requeued on the worker's word, before any heartbeat timeout (4 s here) could call it lost.
    if "worker w1 (rank 0) is shutting down; restart 1 of 2" not in c.log("controller"):
        raise Failure("the controller's log does not requeue the job because w1 is shutting down:\n" +
                      "\n".join(line for line in c.log("controller").splitlines() if name in line))
    ckpt_step = check_resumed_from_newest(c, name, events, ["w2"])
    job = c.wait_state(name, "SUCCEEDED")
    print(f"w1 exited {rc}; {name} SUCCEEDED at step {job.step} on {list(job.workers)}, restarts {job.restarts}, "
          f"resumed after step {ckpt_step}")
    if job.step != 300 or list(job.workers) != ["w2"] or job.restarts != 1:
        raise Failure(f"step {job.step}, workers {list(job.workers)}, restarts {job.restarts}")
    wait_for("the final step event", lambda: steps and steps[-1][0] == 300, timeout=30)


def main():
    ap = arg_parser(cli="the odyssey CLI (empty: submit through gRPC)")
    ap.add_argument("--case", required=True, choices=["sft", "worker_kill", "controller_kill", "data_parallel",
                                                  "context_parallel", "rank_loss", "cancel", "result_while_controller_down",
                                                  "shared_checkpoint_folder", "worker_sigterm", "resume_from_spec",
                                                  "dp_over_cp", "hybrid"])
    args = parse_args(ap)
    outcome = run_test(args.case, f"odyssey-e2e-{args.case}-", args.keep, lambda workdir: Cluster(args, workdir),
                       lambda c: globals()[f"case_{args.case}"](c))
    return 0 if outcome == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
