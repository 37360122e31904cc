#!/usr/bin/env python3
"""Runs docs/guide.md: its shell blocks, in order, as one bash script (set -euo pipefail), on a
tiny Llama made here with transformers (random weights, a BPE tokenizer trained offline:
client/python/tests/tiny_hf.py), on the CPU, with the odyssey_client package pip-installed
(`odyssey-prepare` and `odyssey-plot` on PATH as console scripts).

The block after `<!-- guide-test: setup ... -->` is replaced by this test's values (MODEL, ODYSSEY,
WORK, DEVICE, STEPS, LR, SEQ_LEN); a block after `<!-- guide-test: skip ... -->` is not run.
Then, beyond the guide's own exit status:
  - train.jsonl has a loss mask on every line, with targets and non-targets;
  - loss.png, written by `odyssey plot`, decodes to three panels whose loss line falls
    (client/python/tests/test_plot.py's check_png);
  - the checkpoint folder holds the base folder's tokenizer files;
  - the guide's transformers step printed a fine-tuned loss below the base model's.

Run: python tests/service/guide_test.py --controller build/server/odyssey-controller
       --worker build/worker/odyssey-worker --cli build/client/odyssey --source-dir .
"""
import json
import os
import re
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python", "tests"))
from harness import Failure, arg_parser, parse_args, run_test  # noqa: E402

SETUP_MARK = "<!-- guide-test: setup"
SKIP_MARK = "<!-- guide-test: skip"


def guide_blocks(path):
    """The ```sh blocks of the guide, each as (kind, text): kind "setup", "skip" or "run"."""
    with open(path) as f:
        text = f.read()
    blocks = []
    for m in re.finditer(r"^```sh\n(.*?)^```$", text, re.S | re.M):
        before = text[:m.start()].rstrip()
        last_comment = before[before.rfind("<!--"):] if before.endswith("-->") else ""
        kind = ("setup" if last_comment.startswith(SETUP_MARK) else
                "skip" if last_comment.startswith(SKIP_MARK) else "run")
        blocks.append((kind, m.group(1)))
    return blocks


class Env:
    def __init__(self, workdir):
        self.workdir = workdir
        self.log = os.path.join(workdir, "guide.log")

    def stop(self):
        pass

    def dump_logs(self):
        for name in ("guide.log", "work/controller.log", "work/worker.log"):
            p = os.path.join(self.workdir, name)
            if os.path.exists(p):
                with open(p, errors="replace") as f:
                    print(f"----- {name} -----\n{f.read()[-6000:]}")


def main():
    ap = arg_parser(cli="required", description=__doc__.split("\n\n")[0])
    args = parse_args(ap)
    source = os.path.abspath(args.source_dir)
    build = os.path.dirname(os.path.dirname(os.path.abspath(args.controller)))

    def body(env):
        import tiny_hf
        from process_test import install_client
        import test_plot

        blocks = guide_blocks(os.path.join(source, "docs", "guide.md"))
        kinds = [k for k, _ in blocks]
        if kinds.count("setup") != 1:
            raise Failure(f"docs/guide.md needs exactly one setup block, found {kinds.count('setup')}")
        site = install_client(source, env.workdir)
        model = tiny_hf.make_tiny_llama(os.path.join(env.workdir, "model"))
        work = os.path.join(env.workdir, "work")
        # The CMake tree's layout, which the guide's $ODYSSEY/server, /worker, /client assume.
        for rel, binary in (("server/odyssey-controller", args.controller), ("worker/odyssey-worker", args.worker),
                            ("client/odyssey", args.cli)):
            if os.path.realpath(os.path.join(build, rel)) != os.path.realpath(binary):
                raise Failure(f"{binary} is not {build}/{rel}: the guide assumes the build tree's layout")
        setup = "\n".join([
            f"export MODEL={model}", f"export ODYSSEY={build}", "export PATH=$ODYSSEY/client:$PATH",
            "export DEVICE=cpu", "export STEPS=40 LR=3e-3 SEQ_LEN=128",
            f"export WORK={work} && mkdir -p \"$WORK\" && cd \"$WORK\""])
        script = ["set -euo pipefail",
                  # On a failure, the processes the guide started in the background go too.
                  "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
        for kind, text in blocks:
            if kind == "skip":
                continue
            script.append(setup if kind == "setup" else text)
        script_path = os.path.join(env.workdir, "guide.sh")
        with open(script_path, "w") as f:
            f.write("\n".join(script) + "\n")
        bin_dirs = [os.path.join(site, "bin"), os.path.dirname(sys.executable)]
        run_env = dict(os.environ, PATH=os.pathsep.join(bin_dirs + [os.environ.get("PATH", "")]),
                       PYTHONPATH=os.pathsep.join([site] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
                       ODYSSEY_PYTHON=sys.executable, PIP_DISABLE_PIP_VERSION_CHECK="1")
        run_env.pop("ODYSSEY_CONTROLLER", None)
        with open(env.log, "w") as log:
            rc = subprocess.run(["bash", script_path], stdout=log, stderr=subprocess.STDOUT, env=run_env,
                                timeout=600).returncode
        with open(env.log) as f:
            out = f.read()
        if rc != 0:
            raise Failure(f"the guide's commands failed (exit {rc})")

        with open(os.path.join(work, "train.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        if len(rows) != 4 or not all(0 < sum(r["loss_mask"]) < len(r["tokens"]) for r in rows):
            raise Failure("train.jsonl: expected 4 conversations, each with assistant targets and prompt tokens")
        t = unittest.TestCase()
        try:
            # CPU: the GPU panel is a flat line at 0; tokens/s goes either way.
            test_plot.check_png(t, os.path.join(work, "loss.png"), trends=(-1, 0, 0), min_pixels=50)
        except AssertionError as e:
            raise Failure(f"loss.png: {e}") from None
        m = re.search(r"^jobs/\d+$", out, re.M)
        ckpts = sorted(d for d in os.listdir(os.path.join(work, "checkpoints")) if d.startswith("step-"))
        if not m or not ckpts:
            raise Failure("no job name or no checkpoint")
        have = set(os.listdir(os.path.join(work, "checkpoints", ckpts[-1])))
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            if f not in have:
                raise Failure(f"the checkpoint {ckpts[-1]} lacks {f} (has {sorted(have)})")
        m = re.search(r"loss on the training data: base ([\d.]+), fine-tuned ([\d.]+)", out)
        if not m:
            raise Failure("the guide's transformers step printed no losses")
        base, tuned = float(m.group(1)), float(m.group(2))
        if not tuned < base - 0.5:
            raise Failure(f"fine-tuning did not lower the loss in transformers: base {base}, fine-tuned {tuned}")
        print(f"guide: base loss {base:.3f} -> fine-tuned {tuned:.3f}; plot and checkpoint checked")

    outcome = run_test("guide", "odyssey_guide_", args.keep, Env, body)
    sys.exit(0 if outcome == "ok" else 1)


if __name__ == "__main__":
    main()
