#!/usr/bin/env python3
"""Bearer tokens, tenant isolation and TLS through real processes: an odyssey-controller with
--auth-token-file and --tls-cert/--tls-key, an odyssey-worker attaching over TLS with a worker
token, the odyssey CLI and Python gRPC stubs (generated at run time with grpc_tools.protoc).

A throwaway CA and a server certificate for localhost / 127.0.0.1 are made with the openssl CLI
in a temporary folder, plus a second, unrelated CA. Checked:
  - startup errors name the flag: a key that does not match the certificate (--tls-key), a bad
    token file line (file:line and the rule, never the token);
  - a worker attaches over TLS with its @worker token; tenant alice's job (submitted with the
    CLI over TLS with --token-file) runs to SUCCEEDED;
  - no token -> UNAUTHENTICATED "missing bearer token: ..."; unknown token -> UNAUTHENTICATED
    "bearer token not recognized"; health checks answer without a token;
  - tenant bob gets PERMISSION_DENIED "jobs/N belongs to another tenant" on Get/Cancel/Watch of
    alice's job (gRPC and CLI, exit 5) and does not see it in ListJobs; the same request_id is
    bob's own; a worker token cannot call JobService;
  - a plaintext client against the TLS port fails, a client trusting another CA fails;
  - a worker with a tenant token cannot attach (PERMISSION_DENIED, logged);
  - a token moved to another tenant by a SIGHUP ends the WatchJob stream it holds open with
    PERMISSION_DENIED within 1 s of the signal (the watch re-checks every 250 ms), and the next
    batch of a PushRollouts stream it holds open is refused (each batch authenticated alone);
  - SIGHUP reloads the token file (a new tenant works, a removed token stops working, also on
    a WatchJob stream it holds open: UNAUTHENTICATED), a broken file on SIGHUP keeps the tokens
    in force, and removing the worker token detaches the worker;
  - mTLS (--tls-client-ca): a client without a certificate is refused, one with a certificate
    the CA signed is served; that controller (auth, no --path-root) logs the confinement warning;
  - paths (--path-root, --shared-read-root): a shared root containing the path root is refused
    at startup; alice's default checkpoints land in <root>/alice; alice exports into her folder,
    not into bob's nor into the shared root; bob's LoadCheckpoint of alice's export and his
    CreateJob with model.name = alice's export get PERMISSION_DENIED naming the field; a
    sequenced call refused for its path uses up its sequence; bob may start from a base model in
    the shared read root.
Every wait is on a condition with a deadline.
"""
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_test import tiny_spec  # noqa: E402
from harness import (Failure, Processes, arg_parser, expect_rpc_error, free_port_base, generate_stubs,  # noqa: E402
                     openssl, run_test, wait_for, wait_for_port_file)

DEADLINE_S = 60


def make_pki(workdir):
    """A CA, a server certificate it signs for localhost/127.0.0.1, and an unrelated CA."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl(workdir, "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj",
            "/CN=odyssey test CA")
    openssl(workdir, "req", "-x509", *ec, "-keyout", "other-ca.key", "-out", "other-ca.pem", "-days", "2", "-subj",
            "/CN=unrelated CA")
    openssl(workdir, "req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    with open(os.path.join(workdir, "san.cnf"), "w") as f:
        f.write("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    openssl(workdir, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "2", "-extfile", "san.cnf")
    return {name: os.path.join(workdir, name) for name in
            ("ca.pem", "ca.key", "other-ca.pem", "other-ca.key", "server.pem", "server.key")}


class Env(Processes):
    def __init__(self, args, workdir):
        super().__init__(workdir)
        self.args = args
        self.grpc, self.pb, self.pbg = generate_stubs(args.source_dir, workdir)

    def path(self, name):
        return os.path.join(self.workdir, name)

    def write(self, name, text):
        with open(self.path(name), "w") as f:
            f.write(text)
        return self.path(name)

    def channel(self, ca=None, plaintext=False):
        if plaintext:
            return self.grpc.insecure_channel(self.address)
        creds = self.grpc.ssl_channel_credentials(root_certificates=open(ca, "rb").read())
        # The certificate names localhost; the address is 127.0.0.1 (as --tls-server-name does).
        return self.grpc.secure_channel(self.address, creds, options=[("grpc.ssl_target_name_override", "localhost")])


def run(env):
    grpc, pb, pbg = env.grpc, env.pb, env.pbg
    pki = make_pki(env.workdir)
    tokens = {t: secrets.token_hex(24) for t in ("alice", "bob", "worker", "carol")}
    token_file = env.write("tokens.txt", "\n".join([
        "# odyssey test tokens: <token> <tenant>",
        f"{tokens['alice']} alice",
        f"{tokens['bob']}\tbob",
        "",
        f"{tokens['worker']} @worker",
    ]) + "\n")
    for t in tokens:
        env.write(f"{t}.token", tokens[t] + "\n")

    # --- startup errors name the flag (and never echo a token) ---
    bad = subprocess.run([env.args.controller, "--listen", "127.0.0.1:0", "--state-dir", env.path("bad-state"),
                          "--metrics-listen", "", "--tls-cert", pki["server.pem"], "--tls-key", pki["other-ca.key"]],
                         capture_output=True, text=True, timeout=30)
    if bad.returncode == 0 or "--tls-key" not in bad.stderr or "does not match the certificate in --tls-cert" \
            not in bad.stderr:
        raise Failure(f"mismatched key: exit {bad.returncode}, stderr {bad.stderr!r}")
    print(f"ok: mismatched --tls-key refused: {bad.stderr.strip()}")
    broken = env.write("broken-tokens.txt", f"# x\n{tokens['alice']} alice\nshort-token bob\n")
    bad = subprocess.run([env.args.controller, "--listen", "127.0.0.1:0", "--state-dir", env.path("bad-state"),
                          "--metrics-listen", "", "--auth-token-file", broken],
                         capture_output=True, text=True, timeout=30)
    if bad.returncode == 0 or f"{broken}:3: token is too short" not in bad.stderr or "short-token" in bad.stderr:
        raise Failure(f"bad token file: exit {bad.returncode}, stderr {bad.stderr!r}")
    print(f"ok: bad token file refused: {bad.stderr.strip()}")
    path_root, shared_root = env.path("paths"), env.path("shared")
    os.makedirs(path_root)
    os.makedirs(shared_root)
    bad = subprocess.run([env.args.controller, "--listen", "127.0.0.1:0", "--state-dir", env.path("bad-state"),
                          "--metrics-listen", "", "--path-root", path_root, "--shared-read-root", env.workdir],
                         capture_output=True, text=True, timeout=30)
    if bad.returncode == 0 or "--shared-read-root" not in bad.stderr or "must not contain --path-root" not in bad.stderr:
        raise Failure(f"shared root containing the path root: exit {bad.returncode}, stderr {bad.stderr!r}")
    print(f"ok: a shared read root containing the path root refused: {bad.stderr.strip()}")

    # --- the controller: tokens + TLS ---
    port_file = env.path("controller.port")
    rendezvous_base = free_port_base()
    controller = env.spawn("controller", [
        env.args.controller, "--listen", "127.0.0.1:0", "--port-file", port_file, "--state-dir", env.path("state"),
        "--metrics-listen", "", "--heartbeat-timeout", "4", "--rendezvous-port-base", str(rendezvous_base),
        "--auth-token-file", token_file, "--tls-cert", pki["server.pem"], "--tls-key", pki["server.key"],
        "--path-root", path_root, "--shared-read-root", shared_root])
    port = wait_for_port_file(port_file, "the controller's port file", DEADLINE_S)
    env.address = f"127.0.0.1:{port}"
    channel = env.channel(pki["ca.pem"])
    jobs = pbg.JobServiceStub(channel)

    def md(tenant):
        return [("authorization", f"Bearer {tokens[tenant]}")]

    # Health stays open (Kubernetes probes send no token): SERVING = field 1, value 1.
    health = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda b: b,
                                 response_deserializer=lambda b: b)
    if health(b"", timeout=10) != b"\x08\x01":
        raise Failure("health check without a token did not answer SERVING")
    print("ok: grpc.health.v1.Health/Check answers SERVING without a token")

    # --- a worker attaches over TLS with its token ---
    worker_argv = [env.args.worker, "--controller", env.address, "--device", "cpu", "--threads", "1",
                   "--heartbeat-interval", "0.5", "--max-backoff", "0.5", "--progress-interval", "0",
                   "--tls-ca", pki["ca.pem"], "--tls-server-name", "localhost"]
    env.spawn("w1", worker_argv + ["--worker-id", "w1", "--token-file", env.path("worker.token")])
    wait_for("w1 to attach", lambda: "worker=w1 attached" in env.log("controller"), timeout=DEADLINE_S)

    # --- alice submits through the CLI over TLS with her token file; the job succeeds ---
    cli_tls = ["--controller", env.address, "--tls-ca", pki["ca.pem"], "--tls-server-name", "localhost"]
    spec_path = env.write("spec.json", json.dumps(tiny_spec(steps=8, every=0)))
    out = subprocess.run([env.args.cli, *cli_tls, "--token-file", env.path("alice.token"), "submit", spec_path,
                          "--request-id", "shared-id", "--watch"], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise Failure(f"alice's submit --watch: exit {out.returncode}: {out.stdout}{out.stderr}")
    name = re.search(r"jobs/\d+", out.stdout).group(0)
    job = jobs.GetJob(pb.GetJobRequest(name=name), metadata=md("alice"), timeout=10)
    if pb.Job.State.Name(job.state) != "SUCCEEDED" or job.tenant != "alice" or list(job.workers) != ["w1"]:
        raise Failure(f"alice's job: {job}")
    alice_dir, bob_dir = os.path.join(path_root, "alice"), os.path.join(path_root, "bob")
    if not job.last_checkpoint.startswith(os.path.join(alice_dir, "checkpoints", "job-")):
        raise Failure(f"alice's default checkpoint {job.last_checkpoint!r} is not in {alice_dir}/checkpoints")
    print(f"ok: alice's {name} SUCCEEDED on w1 over TLS (tenant {job.tenant!r}), checkpoint {job.last_checkpoint}")
    # ODYSSEY_TOKEN works as well as --token-file.
    out = subprocess.run([env.args.cli, *cli_tls, "get", name], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "ODYSSEY_TOKEN": tokens["alice"]})
    if out.returncode != 0 or "SUCCEEDED" not in out.stdout:
        raise Failure(f"odyssey get with ODYSSEY_TOKEN: exit {out.returncode}: {out.stdout}{out.stderr}")

    # --- no token, unknown token, worker token on JobService ---
    Code = grpc.StatusCode
    expect_rpc_error("ListJobs without a token", lambda: jobs.ListJobs(pb.ListJobsRequest(), timeout=10),
                     Code.UNAUTHENTICATED, "missing bearer token: send metadata 'authorization: Bearer <token>'")
    expect_rpc_error("GetJob with an unknown token", lambda: jobs.GetJob(
        pb.GetJobRequest(name=name), metadata=[("authorization", "Bearer " + secrets.token_hex(24))], timeout=10),
        Code.UNAUTHENTICATED, "bearer token not recognized")
    expect_rpc_error("CreateJob with a worker token", lambda: jobs.CreateJob(
        pb.CreateJobRequest(spec=job.spec), metadata=md("worker"), timeout=10), Code.PERMISSION_DENIED,
        "worker tokens (tenant @worker) may only call WorkerService.Attach")
    out = subprocess.run([env.args.cli, *cli_tls, "list"], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "ODYSSEY_TOKEN"})
    if out.returncode != 5 or "unauthenticated: missing bearer token" not in out.stderr:
        raise Failure(f"odyssey list without a token: exit {out.returncode}: {out.stderr}")

    # --- bob cannot touch alice's job, does not see it, and has his own request ids ---
    denied = f"{name} belongs to another tenant"
    expect_rpc_error("bob GetJob(alice's)", lambda: jobs.GetJob(pb.GetJobRequest(name=name), metadata=md("bob"),
                                                               timeout=10), Code.PERMISSION_DENIED, denied)
    expect_rpc_error("bob CancelJob(alice's)", lambda: jobs.CancelJob(pb.CancelJobRequest(name=name),
                                                                     metadata=md("bob"), timeout=10),
                     Code.PERMISSION_DENIED, denied)
    expect_rpc_error("bob WatchJob(alice's)", lambda: list(jobs.WatchJob(pb.WatchJobRequest(name=name),
                                                                        metadata=md("bob"), timeout=10)),
                     Code.PERMISSION_DENIED, denied)
    out = subprocess.run([env.args.cli, *cli_tls, "--token-file", env.path("bob.token"), "cancel", name],
                         capture_output=True, text=True, timeout=60)
    if out.returncode != 5 or denied not in out.stderr:
        raise Failure(f"bob's odyssey cancel of alice's job: exit {out.returncode}: {out.stderr}")
    long_spec = pb.JobSpec()
    long_spec.CopyFrom(job.spec)
    long_spec.steps = 100000  # still running when bob cancels it
    bobs = jobs.CreateJob(pb.CreateJobRequest(spec=long_spec, request_id="shared-id"), metadata=md("bob"), timeout=10)
    if bobs.name == name or bobs.tenant != "bob":
        raise Failure(f"bob's CreateJob with alice's request_id returned {bobs.name} (tenant {bobs.tenant!r})")
    bob_list = [j.name for j in jobs.ListJobs(pb.ListJobsRequest(), metadata=md("bob"), timeout=10).jobs]
    alice_list = [j.name for j in jobs.ListJobs(pb.ListJobsRequest(), metadata=md("alice"), timeout=10).jobs]
    if bob_list != [bobs.name] or alice_list != [name]:
        raise Failure(f"ListJobs: bob sees {bob_list}, alice sees {alice_list}")
    print(f"ok: ListJobs: bob sees {bob_list}, alice sees {alice_list}")
    jobs.CancelJob(pb.CancelJobRequest(name=bobs.name), metadata=md("bob"), timeout=10)
    if pb.Job.State.Name(jobs.GetJob(pb.GetJobRequest(name=name), metadata=md("alice"), timeout=10).state) \
            != "SUCCEEDED":
        raise Failure("alice's job changed")

    # --- the TrainingService: alice's RL session answers alice only ---
    training = pbg.TrainingServiceStub(channel)
    rl_spec = pb.JobSpec(kind=pb.RL_SESSION, display_name="alice-rl")
    rl_spec.model.name = "tiny"
    rl_spec.data.seq_len = 64
    rl_spec.data.batch_size = 1
    session = jobs.CreateJob(pb.CreateJobRequest(spec=rl_spec), metadata=md("alice"), timeout=10).name
    wait_for("alice's RL session to run", lambda: pb.Job.State.Name(jobs.GetJob(
        pb.GetJobRequest(name=session), metadata=md("alice"), timeout=10).state) == "RUNNING", timeout=DEADLINE_S)
    datum = pb.Datum(tokens=list(range(65, 81)), target_tokens=list(range(66, 82)))
    fb = pb.ForwardBackwardRequest(job=session, batch=[datum], loss=pb.LossConfig(kind="cross_entropy"))
    reply = training.ForwardBackward(fb, metadata=md("alice"), timeout=60)
    if len(reply.logprobs) != 1 or len(reply.logprobs[0].values) != 16:
        raise Failure(f"alice's ForwardBackward: {reply}")
    expect_rpc_error("bob ForwardBackward(alice's session)", lambda: training.ForwardBackward(
        fb, metadata=md("bob"), timeout=10), Code.PERMISSION_DENIED, f"job: {session} belongs to another tenant")
    expect_rpc_error("bob ExportWeights(alice's session)", lambda: training.ExportWeights(
        pb.ExportWeightsRequest(job=session, directory=env.path("bob-export")), metadata=md("bob"), timeout=10),
        Code.PERMISSION_DENIED, f"job: {session} belongs to another tenant")
    expect_rpc_error("ForwardBackward without a token", lambda: training.ForwardBackward(fb, timeout=10),
                     Code.UNAUTHENTICATED, "missing bearer token")
    if os.path.exists(env.path("bob-export")):
        raise Failure("bob's refused ExportWeights wrote a directory")

    # --- paths: alice writes only into her folder; bob cannot read it; the shared root is read-only ---
    alice_export = os.path.join(alice_dir, "exports", "rl-1")
    training.ExportWeights(pb.ExportWeightsRequest(job=session, directory=alice_export), metadata=md("alice"),
                           timeout=60)
    if not os.path.exists(os.path.join(alice_export, "config.json")):
        raise Failure(f"alice's export wrote no {alice_export}/config.json")
    inside_alice = f"must be inside {alice_dir} (the caller's tenant folder)"
    for where in (os.path.join(bob_dir, "planted"), os.path.join(shared_root, "planted"),
                  os.path.join(alice_dir, "..", "bob", "planted")):
        expect_rpc_error(f"alice ExportWeights into {where}", lambda: training.ExportWeights(
            pb.ExportWeightsRequest(job=session, directory=where), metadata=md("alice"), timeout=10),
            Code.PERMISSION_DENIED, f'directory: "{where}" {inside_alice}')
    if os.path.exists(os.path.join(bob_dir, "planted")) or os.path.exists(os.path.join(shared_root, "planted")):
        raise Failure("a refused ExportWeights wrote a directory")
    # A sequenced call refused for its path still takes its turn: the next sequence runs at once.
    expect_rpc_error("alice sequenced ExportWeights into bob's folder", lambda: training.ExportWeights(
        pb.ExportWeightsRequest(job=session, directory=os.path.join(bob_dir, "planted"), sequence=1),
        metadata=md("alice"), timeout=10), Code.PERMISSION_DENIED, f"{inside_alice}")
    training.Forward(pb.ForwardRequest(job=session, batch=[datum], sequence=2), metadata=md("alice"), timeout=10)
    bob_rl = jobs.CreateJob(pb.CreateJobRequest(spec=pb.JobSpec(
        kind=pb.RL_SESSION, model=rl_spec.model, data=rl_spec.data)), metadata=md("bob"), timeout=10).name
    under_bob = f"must be under {bob_dir} (the caller's tenant folder) or {shared_root} (shared, read-only)"
    expect_rpc_error("bob LoadCheckpoint(alice's export) into his own session", lambda: training.LoadCheckpoint(
        pb.LoadCheckpointRequest(job=bob_rl, directory=alice_export), metadata=md("bob"), timeout=10),
        Code.PERMISSION_DENIED, f'directory: "{alice_export}" {under_bob}')
    jobs.CancelJob(pb.CancelJobRequest(name=bob_rl), metadata=md("bob"), timeout=10)
    stolen = pb.JobSpec()
    stolen.CopyFrom(job.spec)
    stolen.model.name = alice_export
    expect_rpc_error("bob CreateJob(model.name = alice's export)", lambda: jobs.CreateJob(
        pb.CreateJobRequest(spec=stolen), metadata=md("bob"), timeout=10),
        Code.PERMISSION_DENIED, f'spec.model.name: "{alice_export}" {under_bob}')
    planner = pbg.PlannerServiceStub(channel)
    expect_rpc_error("bob Plan(model.name = alice's export)", lambda: planner.Plan(
        pb.PlanRequest(spec=stolen), metadata=md("bob"), timeout=10),
        Code.PERMISSION_DENIED, f'spec.model.name: "{alice_export}" {under_bob}')
    expect_rpc_error("Plan without a token", lambda: planner.Plan(pb.PlanRequest(spec=job.spec), timeout=10),
                     Code.UNAUTHENTICATED, "missing bearer token")
    expect_rpc_error("Plan with a worker token", lambda: planner.Plan(
        pb.PlanRequest(spec=job.spec), metadata=md("worker"), timeout=10), Code.PERMISSION_DENIED, "worker tokens")
    # The operator publishes a base model in the shared read root: every tenant may start from it.
    shutil.copytree(alice_export, os.path.join(shared_root, "base"))
    stolen.model.name = os.path.join(shared_root, "base")
    plan = planner.Plan(pb.PlanRequest(spec=stolen), metadata=md("bob"), timeout=10)
    if not plan.fits or plan.message:
        raise Failure(f"bob's Plan of the shared base model: fits {plan.fits}, {plan.message!r}")
    print(f"ok: bob's Plan of the shared base model: fits, {plan.memory.recompute} on {plan.hardware}")
    based = jobs.CreateJob(pb.CreateJobRequest(spec=stolen), metadata=md("bob"), timeout=10)
    jobs.CancelJob(pb.CancelJobRequest(name=based.name), metadata=md("bob"), timeout=10)
    print(f"ok: paths: alice exports into {alice_dir} only; bob is refused her export (LoadCheckpoint, "
          "model.name) and may use the shared base model")
    jobs.CancelJob(pb.CancelJobRequest(name=session), metadata=md("alice"), timeout=10)
    print(f"ok: TrainingService: alice's {session} answers alice; bob gets PERMISSION_DENIED, no token "
          "UNAUTHENTICATED")

    # --- transport: plaintext and a foreign CA cannot talk to the TLS port (the call fails at
    # once as UNAVAILABLE; DEADLINE_EXCEEDED if the handshake failure comes after the deadline) ---
    no_transport = (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED)
    expect_rpc_error("a plaintext client", lambda: pbg.JobServiceStub(env.channel(plaintext=True)).ListJobs(
        pb.ListJobsRequest(), metadata=md("alice"), timeout=5), no_transport)
    expect_rpc_error("a client trusting another CA", lambda: pbg.JobServiceStub(env.channel(pki["other-ca.pem"]))
                     .ListJobs(pb.ListJobsRequest(), metadata=md("alice"), timeout=5), no_transport)
    out = subprocess.run([env.args.cli, "--controller", env.address, "--token-file", env.path("alice.token"),
                          "--timeout", "5", "list"], capture_output=True, text=True, timeout=60)
    if out.returncode != 4:
        raise Failure(f"odyssey list without --tls-ca against TLS: exit {out.returncode}: {out.stderr}")

    # --- a worker with a tenant token (or none) cannot attach ---
    env.spawn("w-tenant", worker_argv + ["--worker-id", "w-tenant", "--token-file", env.path("alice.token")])
    env.spawn("w-none", worker_argv + ["--worker-id", "w-none"])
    wait_for("w-tenant to be refused", lambda: "refused by the controller" in env.log("w-tenant")
             and "WorkerService.Attach needs a worker token" in env.log("w-tenant"), timeout=DEADLINE_S)
    wait_for("w-none to be refused", lambda: "UNAUTHENTICATED" in env.log("w-none"), timeout=DEADLINE_S)
    if "worker=w-tenant attached" in env.log("controller") or "worker=w-none attached" in env.log("controller"):
        raise Failure("the controller registered a worker without a worker token")
    print("ok: workers with a tenant token / no token are refused and never registered")

    # --- a reload reaches calls already open: alice's token moved to another tenant ends her open
    # WatchJob with PERMISSION_DENIED within 250 ms, and the next batch of her open PushRollouts
    # stream is refused (each batch is authenticated on its own, not once per stream) ---
    initial_tokens = open(token_file).read()
    remap_session = jobs.CreateJob(pb.CreateJobRequest(spec=rl_spec), metadata=md("alice"), timeout=10).name
    wait_for("alice's second RL session to run", lambda: pb.Job.State.Name(jobs.GetJob(
        pb.GetJobRequest(name=remap_session), metadata=md("alice"), timeout=10).state) == "RUNNING",
        timeout=DEADLINE_S)
    alice_watch = {}

    def watch_alices_session():
        try:
            for _ in jobs.WatchJob(pb.WatchJobRequest(name=remap_session), metadata=md("alice"), timeout=DEADLINE_S):
                alice_watch["events"] = alice_watch.get("events", 0) + 1
            alice_watch["end"] = "ended without an error"
        except grpc.RpcError as e:
            alice_watch["end"] = (e.code(), e.details())
        alice_watch["at"] = time.monotonic()
    alice_watcher = threading.Thread(target=watch_alices_session, daemon=True)
    alice_watcher.start()
    wait_for("alice's watch to deliver its first event", lambda: alice_watch.get("events", 0) > 0, timeout=DEADLINE_S)
    rollouts = queue.Queue()
    rollout_batch = pb.RolloutBatch(job=remap_session, batch=[datum], loss=pb.LossConfig(kind="cross_entropy"),
                                    adam=pb.AdamWParams(lr=1e-3))
    results = training.PushRollouts(iter(rollouts.get, None), metadata=md("alice"), timeout=DEADLINE_S)
    rollouts.put(rollout_batch)
    first = next(results)
    if first.optim_step.step != 1:
        raise Failure(f"alice's first rollout batch: {first}")
    env.write("tokens.txt", initial_tokens.replace(f"{tokens['alice']} alice", f"{tokens['alice']} mallory"))
    sighup_at = time.monotonic()
    controller.send_signal(signal.SIGHUP)
    alice_watcher.join(timeout=30)
    end = alice_watch.get("end")
    if alice_watcher.is_alive() or not isinstance(end, tuple) or end[0] != Code.PERMISSION_DENIED \
            or 'now belongs to tenant "mallory"' not in end[1]:
        raise Failure(f"alice's open WatchJob after her token moved to tenant mallory: {end if end else 'still open'}")
    # The watch re-checks its token every 250 ms; the reload itself takes milliseconds. 1 s
    # leaves room for a loaded CI machine and still fails a check every second or slower.
    ended_after = alice_watch["at"] - sighup_at
    print(f"ok: alice's open WatchJob ended {ended_after * 1000:.0f} ms after the SIGHUP that moved her token: "
          f"{end[0].name} {end[1]!r}")
    if ended_after > 1.0:
        raise Failure(f"alice's open WatchJob ended {ended_after:.2f} s after the reload (the watch re-checks "
                      "every 250 ms)")
    rollouts.put(rollout_batch)
    try:
        second = next(results)
        raise Failure(f"the second rollout batch after the token moved to mallory was served: {second}")
    except grpc.RpcError as e:
        if e.code() != Code.PERMISSION_DENIED or f"rollout batch 1: job: {remap_session} belongs to another tenant" \
                not in e.details():
            raise Failure(f"the second rollout batch after the token moved: {e.code().name} {e.details()!r}")
        print(f"ok: the next batch of alice's open PushRollouts stream was refused: {e.code().name} {e.details()!r}")
    rollouts.put(None)
    env.write("tokens.txt", initial_tokens)
    controller.send_signal(signal.SIGHUP)

    def alice_is_back():
        try:
            jobs.GetJob(pb.GetJobRequest(name=remap_session), metadata=md("alice"), timeout=10)
            return True
        except grpc.RpcError:
            return False
    wait_for("alice's token to map to alice again", alice_is_back, timeout=DEADLINE_S)
    jobs.CancelJob(pb.CancelJobRequest(name=remap_session), metadata=md("alice"), timeout=10)

    # --- SIGHUP reloads the token file; a broken file keeps the tokens in force ---
    expect_rpc_error("carol before the reload", lambda: jobs.ListJobs(pb.ListJobsRequest(), metadata=md("carol"),
                                                                     timeout=10), Code.UNAUTHENTICATED)
    # bob watches a job that stays PENDING (2 ranks, one worker) while his token is removed.
    pending_spec = pb.JobSpec()
    pending_spec.CopyFrom(long_spec)
    pending_spec.parallel.world_size = 2
    pending = jobs.CreateJob(pb.CreateJobRequest(spec=pending_spec), metadata=md("bob"), timeout=10).name
    watch_outcome = {}

    def watch_bobs_job():
        try:
            for _ in jobs.WatchJob(pb.WatchJobRequest(name=pending), metadata=md("bob"), timeout=DEADLINE_S):
                watch_outcome.setdefault("events", 0)
                watch_outcome["events"] += 1
            watch_outcome["end"] = "ended without an error"
        except grpc.RpcError as e:
            watch_outcome["end"] = (e.code(), e.details())
    watcher = threading.Thread(target=watch_bobs_job, daemon=True)
    watcher.start()
    wait_for("bob's watch to deliver the job's first event", lambda: watch_outcome.get("events", 0) > 0,
             timeout=DEADLINE_S)
    env.write("tokens.txt", f"{tokens['alice']} alice\n{tokens['worker']} @worker\n{tokens['carol']} carol\n")
    controller.send_signal(signal.SIGHUP)

    def reloaded():
        try:
            jobs.ListJobs(pb.ListJobsRequest(), metadata=md("carol"), timeout=10)
            return True
        except grpc.RpcError:
            return False
    wait_for("carol's token to work after SIGHUP", reloaded, timeout=DEADLINE_S)
    expect_rpc_error("bob after his token was removed", lambda: jobs.ListJobs(
        pb.ListJobsRequest(), metadata=md("bob"), timeout=10), Code.UNAUTHENTICATED, "bearer token not recognized")
    watcher.join(timeout=10)
    end = watch_outcome.get("end")
    if watcher.is_alive() or not isinstance(end, tuple) or end[0] != Code.UNAUTHENTICATED \
            or "stopped working while it was open" not in end[1]:
        raise Failure(f"bob's open WatchJob stream after his token was removed: {end if end else 'still open'}")
    print(f"ok: bob's open WatchJob stream ended when his token was removed: {end[0].name} {end[1]!r}")
    env.write("tokens.txt", "garbage\n")
    controller.send_signal(signal.SIGHUP)
    wait_for("the controller to log the broken reload", lambda: "keeping the current tokens" in env.log("controller"),
             timeout=DEADLINE_S)
    jobs.ListJobs(pb.ListJobsRequest(), metadata=md("carol"), timeout=10)  # still works
    print("ok: SIGHUP reload (carol in, bob out); a broken file keeps the tokens")
    # Revoking the worker token detaches w1 at its next heartbeat; it is refused from then on.
    env.write("tokens.txt", f"{tokens['alice']} alice\n{tokens['carol']} carol\n")
    controller.send_signal(signal.SIGHUP)
    wait_for("w1 to be detached after its token was revoked", lambda: "worker=w1 disconnected" in env.log("controller"),
             timeout=DEADLINE_S)
    wait_for("w1 to log the refusal", lambda: "stopped working while it was open" in env.log("w1")
             or "bearer token not recognized" in env.log("w1"), timeout=DEADLINE_S)
    print("ok: revoking the worker token detached w1; it is refused from then on")
    # --- mTLS: a controller with --tls-client-ca takes only clients with a certificate it signed ---
    openssl(env.workdir, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
            "client.key", "-out", "client.csr", "-subj", "/CN=odyssey client")
    openssl(env.workdir, "x509", "-req", "-in", "client.csr", "-CA", pki["ca.pem"], "-CAkey", pki["ca.key"],
            "-CAcreateserial", "-out", "client.pem", "-days", "2")
    mtls_port_file = env.path("mtls.port")
    mtls_tokens = env.write("mtls-tokens.txt", f"{tokens['alice']} alice\n")
    env.spawn("controller-mtls", [
        env.args.controller, "--listen", "127.0.0.1:0", "--port-file", mtls_port_file, "--state-dir",
        env.path("state-mtls"), "--metrics-listen", "", "--auth-token-file", mtls_tokens,
        "--tls-cert", pki["server.pem"], "--tls-key", pki["server.key"], "--tls-client-ca", pki["ca.pem"]])
    mtls_port = wait_for_port_file(mtls_port_file, "the mTLS controller's port file", DEADLINE_S)
    mtls = ["--controller", f"127.0.0.1:{mtls_port}", "--tls-ca", pki["ca.pem"],
            "--tls-server-name", "localhost", "--token-file", env.path("alice.token"), "--timeout", "5"]
    out = subprocess.run([env.args.cli, *mtls, "list"], capture_output=True, text=True, timeout=60)
    if out.returncode != 4:
        raise Failure(f"mTLS without a client certificate: exit {out.returncode}: {out.stdout}{out.stderr}")
    out = subprocess.run([env.args.cli, *mtls, "--tls-cert", env.path("client.pem"), "--tls-key",
                          env.path("client.key"), "list"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise Failure(f"mTLS with a client certificate: exit {out.returncode}: {out.stdout}{out.stderr}")
    out = subprocess.run([env.args.cli, *mtls, "--tls-cert", env.path("client.pem"), "--tls-key",
                          pki["server.key"], "list"], capture_output=True, text=True, timeout=60)
    if out.returncode != 2 or "does not match the certificate in --tls-cert" not in out.stderr:
        raise Failure(f"CLI with a mismatched --tls-key: exit {out.returncode}: {out.stderr}")
    print("ok: mTLS: refused without a client certificate, served with one; a mismatched client key is a usage error")
    if "auth is on but --path-root is not set" not in env.log("controller-mtls"):
        raise Failure("a controller with auth and no --path-root did not log the confinement warning")
    if "--path-root is not set" in env.log("controller"):
        raise Failure("the controller with --path-root logged the confinement warning")
    print("ok: auth without --path-root logs the confinement warning")

    for t in tokens.values():
        for log in env.logs:
            if t in open(log, errors="replace").read():
                raise Failure(f"a token appears in {log}")


def main():
    args = arg_parser(cli="required").parse_args()
    if not shutil.which("openssl"):
        print("FAILED: the openssl CLI is missing (scripts/setup.sh installs it)")
        return 1
    outcome = run_test("auth", "odyssey-auth-", args.keep, lambda workdir: Env(args, workdir), run)
    return 0 if outcome == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
