"""Scaffolding shared by the process tests: the drivers that start a real odyssey-controller and
odyssey-worker (and use the odyssey CLI or gRPC) on loopback ports picked at run time.

Used by tests/service/e2e_test.py, rl_test.py, auth_test.py, soak_test.py and
client/python/tests/process_test.py (which puts this folder on sys.path). What is here:

  Failure, Skip, SKIP    a check failed (exit 1) / the case cannot run here (exit SKIP = 77,
                         ctest's SKIP_RETURN_CODE).
  wait_for               polls a condition until it holds or a deadline passes (no sleep-and-hope).
  wait_for_port_file     waits for a --port-file / --metrics-port-file and returns the port in it.
  free_port_base         a port free now, minus one: a --rendezvous-port-base that tests running
                         at the same time do not share.
  Processes              spawns processes with one log file each; checks they still run; stops
                         them; dumps the logs.
  generate_stubs         Python gRPC stubs for proto/odyssey/v1/odyssey.proto (grpc_tools.protoc).
  scrape                 a Prometheus /metrics page as {series: value}.
  expect_rpc_error       a call must fail with a given status code and message.
  openssl                runs the openssl CLI (test certificates).
  arg_parser, run_test   the drivers' common flags, and their main(): a work folder, the case,
                         stop, logs on failure, the work folder removed, one summary line.
"""
import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

DEADLINE_S = 180  # generous: CI runs tests two at a time on two cores
SKIP = 77  # ctest's SKIP_RETURN_CODE for the drivers that can skip


class Failure(Exception):
    """A check failed: the driver prints it, dumps the process logs and exits 1."""


class Skip(Exception):
    """The case cannot run against these binaries: the driver prints it and exits SKIP."""


def wait_for(what, cond, timeout=DEADLINE_S, poll=0.05):
    """Polls cond() until it returns a truthy value (returned) or `timeout` seconds pass
    (Failure naming `what`)."""
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise Failure(f"timed out after {timeout}s waiting for {what}")
        time.sleep(poll)


def _read(path):
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read().strip()


def wait_for_port_file(path, what, timeout=DEADLINE_S):
    """Waits until the file a process writes its port to (--port-file, --metrics-port-file)
    is there and not empty; returns the port."""
    return int(wait_for(what, lambda: _read(path), timeout))


def free_port_base():
    """A port free now, minus one. Job N's rank 0 listens on --rendezvous-port-base + N, so this
    keeps tests running at the same time off the controller's default base (and each other's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1] - 1


class Processes:
    """The processes a test started, each with its output appended to <workdir>/<name>.log."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.procs = []  # (name, Popen) started and not yet stopped, in start order
        self.logs = []  # every log written, once each

    def spawn(self, name, argv, **popen_kwargs):
        """Starts argv in its own session, stdout and stderr to <name>.log (appended: a restart
        under the same name adds to it); popen_kwargs (cwd, env, ...) go to Popen."""
        log_path = os.path.join(self.workdir, f"{name}.log")
        if log_path not in self.logs:
            self.logs.append(log_path)
        with open(log_path, "ab") as log:
            p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **popen_kwargs)
        self.procs.append((name, p))
        return p

    def log(self, name):
        """The text of <name>.log so far."""
        with open(os.path.join(self.workdir, f"{name}.log"), errors="replace") as f:
            return f.read()

    def check_alive(self):
        """Failure if a process started since the last stop() has exited."""
        for name, p in self.procs:
            if p.poll() is not None:
                raise Failure(f"{name} exited with {p.returncode}")

    def stop(self):
        """SIGTERM to every process still running (the latest started first), then waits up to
        20 s for each before SIGKILL. Processes spawned later are stopped by the next stop()."""
        procs, self.procs = [p for _, p in reversed(self.procs)], []
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def dump_logs(self):
        """Prints the last 40 lines of every log (on failure)."""
        for path in self.logs:
            print(f"----- {path} (last 40 lines)")
            with open(path, errors="replace") as f:
                print("".join(f.readlines()[-40:]))


def generate_stubs(source_dir, workdir):
    """Generates the Python stubs of odyssey.proto into <workdir>/gen with the venv's
    grpcio-tools, puts them on sys.path and returns (grpc, odyssey_pb2, odyssey_pb2_grpc)."""
    gen = os.path.join(workdir, "gen")
    os.makedirs(gen, exist_ok=True)
    import grpc_tools
    from grpc_tools import protoc

    proto_root = os.path.join(source_dir, "proto")
    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main(["protoc", f"-I{proto_root}", f"-I{well_known}", f"--python_out={gen}", f"--grpc_python_out={gen}",
                      os.path.join(proto_root, "odyssey/v1/odyssey.proto")])
    if rc != 0:
        raise Failure("protoc failed on odyssey.proto")
    sys.path.insert(0, gen)
    import grpc
    from odyssey.v1 import odyssey_pb2, odyssey_pb2_grpc

    return grpc, odyssey_pb2, odyssey_pb2_grpc


def scrape(port):
    """The Prometheus text page at 127.0.0.1:<port>/metrics as {'name{labels}': value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def expect_rpc_error(what, call, code, *substrings, show="ok: {what}: {code} {details!r}"):
    """Runs call(); it must raise grpc.RpcError with `code` (a StatusCode or a tuple of them)
    and a message containing every one of `substrings`, else Failure. Prints `show` (a format
    of what, code (its name) and details) and returns the error."""
    import grpc
    codes = code if isinstance(code, tuple) else (code,)
    try:
        call()
    except grpc.RpcError as e:
        details = e.details() or ""
        if e.code() not in codes:
            raise Failure(f"{what}: got {e.code()} ({details!r}), want {code}")
        for s in substrings:
            if s not in details:
                raise Failure(f"{what}: message {details!r} does not name {s!r}")
        print(show.format(what=what, code=e.code().name, details=details))
        return e
    raise Failure(f"{what}: succeeded, want {code}")


def openssl(cwd, *argv):
    """Runs `openssl argv...` in cwd; Failure with its stderr if it fails."""
    out = subprocess.run(["openssl", *argv], cwd=cwd, capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise Failure(f"openssl {' '.join(argv)} failed: {out.stderr}")


def arg_parser(cli=None, **kwargs):
    """An ArgumentParser (kwargs go to it) with the flags every driver takes: --controller and
    --worker (the binaries), --source-dir (the checkout: proto/, client/), --keep (keep the work
    folder); with --cli too when `cli` is given: "required", or the flag's help text (optional,
    default "": see parse_args)."""
    ap = argparse.ArgumentParser(**kwargs)
    ap.add_argument("--controller", required=True)
    ap.add_argument("--worker", required=True)
    ap.add_argument("--source-dir", required=True)
    if cli == "required":
        ap.add_argument("--cli", required=True)
    elif cli is not None:
        ap.add_argument("--cli", default="", help=cli)
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.optional_cli = cli is not None and cli != "required"
    return ap


def parse_args(ap):
    """ap.parse_args(), with an optional --cli that does not exist taken as none ("")."""
    args = ap.parse_args()
    if getattr(ap, "optional_cli", False) and args.cli and not os.path.exists(args.cli):
        args.cli = ""
    return args


def run_test(label, workdir_prefix, keep, make_env, body, keep_failed=False, fail_word="FAILED"):
    """A driver's main(): makes a work folder, env = make_env(workdir), runs body(env). A Failure
    prints "<fail_word>: <why>", a Skip "SKIPPED: <why>". Then env.stop(), env.dump_logs() on
    failure, and the work folder is removed unless `keep` (or, with keep_failed, the run failed:
    then "work folder kept: <path>" is printed). With a label, prints "<label>: ok|FAILED in
    <seconds>s". Returns "ok", "skipped" or "FAILED"."""
    workdir = tempfile.mkdtemp(prefix=workdir_prefix)
    t0 = time.monotonic()
    outcome = "FAILED"
    env = None
    try:
        env = make_env(workdir)
        body(env)
        outcome = "ok"
    except Skip as e:
        print(f"SKIPPED: {e}")
        outcome = "skipped"
    except Failure as e:
        print(f"{fail_word}: {e}")
    finally:
        if env is not None:
            env.stop()
            if outcome == "FAILED":
                env.dump_logs()
        if not keep and not (keep_failed and outcome == "FAILED"):
            shutil.rmtree(workdir, ignore_errors=True)
        elif keep_failed:
            print(f"work folder kept: {workdir}")
    if label:
        print(f"{label}: {'ok' if outcome == 'ok' else 'FAILED'} in {time.monotonic() - t0:.1f}s")
    return outcome
