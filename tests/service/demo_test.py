#!/usr/bin/env python3
"""scripts/demo.sh as a user runs it, interrupted: Ctrl-C cancels the job and says so.

Runs `scripts/demo.sh --no-build --out TMP --steps 100000` (the binaries of build/ as they are,
everything under a temporary folder: the user's out/ is untouched) in a process group of its own,
waits for the demo to print the job it submitted and for a progress line, then sends SIGINT to
the group, as a terminal's Ctrl-C does. The demo must say `demo: interrupted: cancelled jobs/1
at step N / 100000 (CANCELLED)`, stop its controller and worker (their pids, from the port files'
processes, are gone) and exit 130. Every wait is on the demo's own output, with a deadline.
"""
import argparse
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

DEADLINE_S = 180


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    out = tempfile.mkdtemp(prefix="odyssey-demo-test-")
    demo = subprocess.Popen(["bash", os.path.join(args.source_dir, "scripts", "demo.sh"), "--no-build", "--out", out,
                             "--steps", "100000", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    lines = []

    def read_until(pattern, timeout):
        end = time.monotonic() + timeout
        buf = b""
        while time.monotonic() < end:
            ready, _, _ = select.select([demo.stdout], [], [], 0.5)
            if not ready:
                if demo.poll() is not None:
                    break
                continue
            chunk = os.read(demo.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                lines.append(line.decode(errors="replace"))
                if re.search(pattern, lines[-1]):
                    return lines[-1]
        return None

    ok = False
    try:
        submitted = read_until(r"demo: submitted jobs/\d+", DEADLINE_S)
        if not submitted:
            raise RuntimeError("the demo never said which job it submitted")
        job = re.search(r"jobs/\d+", submitted).group(0)
        if not read_until(re.escape(job) + r" \[.*\] step \d+/100000", DEADLINE_S):
            raise RuntimeError(f"no progress line for {job}")
        os.killpg(demo.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole foreground group
        said = read_until(r"demo: interrupted: ", 60)
        read_until(r"demo: stopped", 60)
        rc = demo.wait(timeout=60)
        print(f"demo said: {said!r}; exit {rc}")
        if not said or not re.fullmatch(rf"demo: interrupted: cancelled {job} at step \d+ / 100000 \(CANCELLED\)", said):
            raise RuntimeError(f"the demo did not say it cancelled {job}: {said!r}")
        if rc != 130:
            raise RuntimeError(f"exit code {rc}, want 130 (interrupted)")
        # The daemons it started (their own sessions) are gone: nothing still holds the store.
        for name in ("controller", "worker"):
            log = os.path.join(out, "demo-state", f"{name}.log")
            if not os.path.exists(log):
                raise RuntimeError(f"no {name} log")
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        if os.path.join(out, "demo-state") in ps:
            raise RuntimeError(f"a demo process still runs:\n{ps}")
        print(f"ok: Ctrl-C cancelled {job} and the demo said so")
        ok = True
    except Exception as e:  # noqa: BLE001 - report and fail
        print(f"FAILED: {e}")
        print("demo output:\n  " + "\n  ".join(lines[-40:]))
        for name in ("controller", "worker"):
            log = os.path.join(out, "demo-state", f"{name}.log")
            if os.path.exists(log):
                print(f"--- {name}.log (tail)\n" + "".join(open(log, errors="replace").readlines()[-20:]))
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    print("demo_test: " + ("ok" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
