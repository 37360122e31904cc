#!/usr/bin/env python3
"""Process tests of the TrainingService (RL sessions): a real odyssey-controller and a real
odyssey-worker (CPU, the `tiny` byte-level model) on loopback ports picked at run time, driven
through gRPC with Python stubs generated at test time (grpc_tools.protoc from the venv).

Cases (--case):
  train        (a) forward_backward(cross_entropy) + optim_step repeated on a fixed batch lowers
               the loss, and GetJob shows the session's step and loss; (c) save_checkpoint, train
               more, load_checkpoint: forward equals the logprobs at save time and the optimizer
               step counter is restored (the next optim_step continues from it); (d) pipelined
               calls, issued as futures without waiting, unsequenced and sequenced (issued in
               reverse order: the controller forwards by sequence), all succeed, and the
               sequenced ones run in sequence order (optim_step's step numbers); (g) PushRollouts
               streams one result per batch, in order.
  hf_parity    (b) forward's per-token logprobs equal Hugging Face transformers' on the weights
               ExportWeights(float32) wrote (max |diff| <= 1e-4), which also proves the export
               loads in transformers; a bfloat16 export is written as bfloat16; a checkpoint of
               another shape is refused before anything is loaded. (i) Sample: greedy sampling
               (temperature 0, a stop token) gives exactly the tokens of transformers' greedy
               `generate` on those exported weights, for a batch of prompts of different
               lengths; the sampled tokens' logprobs equal Forward's; seeded sampling
               (temperature 1, top-k, top-p, 3 samples per prompt) gives the same tokens for the
               same seed and other tokens for another; a Sample after an optim_step sees the new
               weights (sampling is ordered with the session's calls).
  bad_input    (e) a table of bad requests, each INVALID_ARGUMENT naming the field (with the datum
               and token index) and the rule (Sample's fields included), after which the session
               still trains; (f) the
               trainer-vs-sampler mismatch gauges appear on the controller's /metrics after a
               forward_backward with sampler logprobs, with the values the call returned.
  cancel       (h) the odyssey CLI creates a session from client/examples/rl-session.yaml (when
               --cli is given) and `odyssey get` shows its step; cancel ends the session
               (CANCELLED), a later call gets FAILED_PRECONDITION naming the state; a session
               with a 2 s idle timeout ends SUCCEEDED on its own.
  worker_loss  SaveCheckpoint sets the job's last_checkpoint; kill -9 of the session's worker
               requeues the session (calls meanwhile get FAILED_PRECONDITION "is PENDING"), and
               on a new worker it resumes from that checkpoint: same logprobs, step counter
               continues from the saved step.
  data_parallel
               a session of parallel.world_size 2 on two CPU workers (its ranks meet at the
               controller's rendezvous) against a 1-worker session of the same seed and model: on
               one batch of 5 datums of different lengths (one with weights) the logprobs agree
               within 1e-5 and the loss (the ranks' shares summed) within 1e-5; after 3
               forward_backward + optim_step rounds forward's logprobs still agree within 1e-4;
               ExportWeights of the 2-rank session loads in transformers and matches its forward
               (<= 1e-4); a bad datum at whole-batch index 3 (in rank 1's slice) comes back
               INVALID_ARGUMENT naming batch[3], and the session still trains.
  context_parallel
               a session of parallel.world_size 2 with context_parallel 2 (every worker the whole
               batch, its half of each datum's positions) against a 1-worker session: the same
               logprobs and loss within 1e-5 on datums of odd lengths with weights, sampler
               logprobs and advantages (ppo: the same mismatch and clipped counts); 3
               forward_backward + optim_step rounds give the same grad norms and then the same
               forward within 1e-4; its ExportWeights loads in transformers and matches its
               forward; a bad datum is INVALID_ARGUMENT naming it; Sample is UNIMPLEMENTED naming
               context_parallel; a batch over the whole-batch limit is refused naming it.
  dp_over_cp   a session of parallel.world_size 4 with context_parallel 2 (two data-parallel
               context-parallel pairs, each one slice of the batch) against a 1-worker session:
               the same logprobs, loss and counts within 1e-5, 3 rounds of training alike,
               its export loads in transformers, a bad datum in the second group's slice is
               INVALID_ARGUMENT naming it.

Every wait is on a condition with a deadline.
"""
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_test import Cluster  # noqa: E402
from harness import (Failure, arg_parser, expect_rpc_error, parse_args, run_test, scrape, wait_for,  # noqa: E402
                     wait_for_port_file)

VOCAB = 256  # the tiny model's byte vocabulary
SEQ_LEN, BATCH_SIZE = 64, 4  # the session's plan: 256 positions per call


class RlCluster(Cluster):
    def start_controller(self):
        """Starts the controller (like Cluster's) and records its metrics port."""
        metrics_file = os.path.join(self.workdir, "controller.metrics-port")
        super().start_controller(extra=["--metrics-port-file", metrics_file])
        self.metrics_port = wait_for_port_file(metrics_file, "the controller's metrics port")
        self.training = self.pbg.TrainingServiceStub(self.channel)

    def session(self, idle_timeout=0, restart_limit=0, world_size=1, context_parallel=0):
        spec = self.pb.JobSpec(kind=self.pb.RL_SESSION, display_name="rl-test")
        spec.parallel.world_size = world_size
        spec.parallel.context_parallel = context_parallel
        spec.model.name = "tiny"
        spec.model.dtype = "float32"
        spec.data.seq_len = SEQ_LEN
        spec.data.batch_size = BATCH_SIZE
        spec.optimizer.grad_clip = 1.0
        spec.rl.idle_timeout_seconds = idle_timeout
        spec.restart_limit = restart_limit
        name = self.jobs.CreateJob(self.pb.CreateJobRequest(spec=spec), timeout=10).name
        self.wait_state(name, "RUNNING")
        return name

    def datum(self, tokens, **arrays):
        d = self.pb.Datum(tokens=tokens[:-1], target_tokens=tokens[1:])
        for k, v in arrays.items():
            getattr(d, k).extend(v)
        return d

    def batch(self, seed, n=4, length=33):
        rng = random.Random(seed)
        return [self.datum([rng.randrange(VOCAB) for _ in range(length)]) for _ in range(n)]

    def fb(self, job, batch, kind="cross_entropy", **kw):
        return self.training.ForwardBackward(
            self.pb.ForwardBackwardRequest(job=job, batch=batch, loss=self.pb.LossConfig(kind=kind), **kw), timeout=120)

    def step(self, job, lr=1e-2, **kw):
        return self.training.OptimStep(self.pb.OptimStepRequest(job=job, adam=self.pb.AdamWParams(lr=lr), **kw),
                                       timeout=120)

    def sample(self, job, prompts, n=1, **params):
        return self.training.Sample(self.pb.SampleRequest(job=job, prompts=[self.pb.SamplePrompt(tokens=p) for p in prompts],
                                                          num_samples=n, params=self.pb.SamplingParams(**params)),
                                    timeout=120)

    def forward(self, job, batch):
        r = self.training.Forward(self.pb.ForwardRequest(job=job, batch=batch), timeout=120)
        return [list(l.values) for l in r.logprobs]


def max_diff(a, b):
    return max(abs(x - y) for la, lb in zip(a, b) for x, y in zip(la, lb))


def transformers_max_diff(export, probe, ours):
    """Largest |difference| between `ours` (per-datum logprobs of the session) and transformers'
    logprobs of the same target tokens, with the model loaded from the exported folder."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32)
    model.eval()
    worst = 0.0
    for d, mine in zip(probe, ours):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([list(d.tokens)])).logits[0].float()
        ref = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(list(d.target_tokens))[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(mine)).abs().max().item())
    return worst


def expect_code(what, fn, code, *substrings):
    """fn() must fail with `code` and a message naming every substring; returns the message."""
    return expect_rpc_error(what, fn, code, *substrings, show="  {what}: {code}: {details}").details()


def case_train(c):
    c.start_controller()
    c.start_worker("w1")
    job = c.session()
    batch = c.batch(seed=1)
    # (a) the loss falls on a fixed batch, and GetJob follows the session.
    losses = []
    for i in range(12):
        r = c.fb(job, batch)
        losses.append(r.loss)
        if len(r.logprobs) != 4 or any(len(l.values) != 32 for l in r.logprobs) or r.tokens != 128:
            raise Failure(f"forward_backward returned {len(r.logprobs)} logprob rows, {r.tokens} tokens")
        s = c.step(job)
        if s.step != i + 1:
            raise Failure(f"optim_step {i + 1} returned step {s.step}")
    print(f"(a) loss on a fixed batch: {losses[0]:.3f} -> {losses[-1]:.3f} over 12 steps")
    if not (abs(losses[0] - math.log(VOCAB)) < 0.5 and losses[-1] < losses[0] - 1.0):
        raise Failure(f"the loss did not fall from chance: {losses}")
    got = wait_for("GetJob to show step 12", lambda: (lambda j: j if j.step == 12 else None)(c.get(job)), timeout=30)
    if abs(got.loss - losses[-1]) > 1e-6:
        raise Failure(f"GetJob loss {got.loss}, want the last forward_backward's {losses[-1]}")

    # (c) save, train more, load: logprobs and step counter come back.
    probe = c.batch(seed=2, n=2, length=20)
    at_save = c.forward(job, probe)
    saved = c.training.SaveCheckpoint(c.pb.SaveCheckpointRequest(job=job), timeout=120)
    print(f"(c) saved {saved.directory} at step {saved.step}")
    if saved.step != 12 or not re.search(r"step-0*12$", saved.directory) or not os.path.isdir(saved.directory):
        raise Failure(f"save_checkpoint returned {saved}")
    if any(n.startswith(".") for n in os.listdir(os.path.dirname(saved.directory))):
        raise Failure(f"temp folders left beside {saved.directory}: {os.listdir(os.path.dirname(saved.directory))}")
    wait_for("last_checkpoint to be the saved one", lambda: c.get(job).last_checkpoint == saved.directory, timeout=10)
    for _ in range(3):
        c.fb(job, batch)
        c.step(job)
    moved = max_diff(c.forward(job, probe), at_save)
    if moved < 1e-4:
        raise Failure(f"training after the save did not change the logprobs ({moved})")
    loaded = c.training.LoadCheckpoint(c.pb.LoadCheckpointRequest(job=job, directory=saved.directory), timeout=120)
    back = max_diff(c.forward(job, probe), at_save)
    print(f"    after 3 more steps the logprobs moved by {moved:.4f}; after load_checkpoint (step {loaded.step}) "
          f"they differ from save time by {back:.2e}")
    if loaded.step != 12 or back > 1e-6:
        raise Failure(f"load_checkpoint: step {loaded.step}, logprob diff {back}")
    c.fb(job, batch)
    if c.step(job).step != 13:
        raise Failure("the optimizer step counter was not restored by load_checkpoint")

    # (d) pipelined calls. Unsequenced: futures issued without waiting all succeed.
    futures = [c.training.Forward.future(c.pb.ForwardRequest(job=job, batch=probe), timeout=120) for _ in range(3)]
    futures += [c.training.ForwardBackward.future(
        c.pb.ForwardBackwardRequest(job=job, batch=batch, loss=c.pb.LossConfig(kind="cross_entropy")), timeout=120)
        for _ in range(3)]
    for f in futures:
        f.result()
    if c.step(job).step != 14:
        raise Failure("optim_step after pipelined calls")
    # Sequenced: forward_backward (odd) and optim_step (even) issued in reverse order; the
    # controller forwards them 1, 2, 3, ..., so every optim_step finds its gradients.
    n = 4
    calls = []
    for k in range(1, n + 1):
        calls.append((2 * k - 1, lambda s: c.training.ForwardBackward.future(c.pb.ForwardBackwardRequest(
            job=job, batch=batch, loss=c.pb.LossConfig(kind="cross_entropy"), sequence=s), timeout=120)))
        calls.append((2 * k, lambda s: c.training.OptimStep.future(
            c.pb.OptimStepRequest(job=job, adam=c.pb.AdamWParams(lr=1e-2), sequence=s), timeout=120)))
    issued = {}
    for seq, make in reversed(calls):
        issued[seq] = make(seq)
    steps = [issued[2 * k].result().step for k in range(1, n + 1)]
    for k in range(1, n + 1):
        issued[2 * k - 1].result()
    print(f"(d) pipelined: 6 unsequenced calls ok; sequenced calls issued in reverse ran in order: steps {steps}")
    if steps != list(range(15, 15 + n)):
        raise Failure(f"sequenced optim_steps returned {steps}, want {list(range(15, 15 + n))}")
    expect_code("a repeated sequence", lambda: c.step(job, sequence=2), c.grpc.StatusCode.ALREADY_EXISTS,
                "sequence")

    # (g) PushRollouts: one result per batch, in order.
    def rollouts():
        for i in range(3):
            yield c.pb.RolloutBatch(job=job, batch=c.batch(seed=10 + i), loss=c.pb.LossConfig(kind="cross_entropy"),
                                    adam=c.pb.AdamWParams(lr=1e-2))
    results = list(c.training.PushRollouts(rollouts(), timeout=120))
    got = [r.optim_step.step for r in results]
    print(f"(g) PushRollouts: steps {got}, losses {[round(r.forward_backward.loss, 3) for r in results]}")
    if got != [19, 20, 21] or any(r.forward_backward.tokens != 128 for r in results):
        raise Failure(f"PushRollouts results {got}")
    # A failing batch ends the stream with its status after the good ones' results.
    bad = c.pb.RolloutBatch(job=job, batch=[c.datum([1, 300])], loss=c.pb.LossConfig(kind="cross_entropy"),
                            adam=c.pb.AdamWParams(lr=1e-2))
    good = c.pb.RolloutBatch(job=job, batch=batch, loss=c.pb.LossConfig(kind="cross_entropy"),
                             adam=c.pb.AdamWParams(lr=1e-2))
    seen = []
    try:
        for r in c.training.PushRollouts(iter([good, bad, good]), timeout=120):
            seen.append(r.optim_step.step)
        raise Failure("PushRollouts with a bad batch ended OK")
    except c.grpc.RpcError as e:
        if e.code() != c.grpc.StatusCode.INVALID_ARGUMENT or "rollout batch 1" not in e.details() or seen != [22]:
            raise Failure(f"PushRollouts with a bad second batch: {e.code()} {e.details()}, results {seen}")


def case_hf_parity(c):
    import torch

    c.start_controller()
    c.start_worker("w1")
    job = c.session()
    batch = c.batch(seed=3)
    for _ in range(3):  # trained weights, not the init
        c.fb(job, batch)
        c.step(job)
    probe = c.batch(seed=4, n=3, length=41) + [c.datum([7, 8, 9])]
    ours = c.forward(job, probe)
    export = os.path.join(c.workdir, "export-f32")
    r = c.training.ExportWeights(c.pb.ExportWeightsRequest(job=job, directory=export, dtype="float32"), timeout=120)
    if r.directory != export or not {"config.json", "model.safetensors"} <= set(os.listdir(export)):
        raise Failure(f"export_weights wrote {r.directory}: {os.listdir(r.directory)}")
    worst = transformers_max_diff(export, probe, ours)
    print(f"(b) forward vs transformers on the exported float32 weights: max |diff| = {worst:.2e}")
    if worst > 1e-4:
        raise Failure(f"logprobs differ from transformers by {worst}")
    bf16 = os.path.join(c.workdir, "export-bf16")
    c.training.ExportWeights(c.pb.ExportWeightsRequest(job=job, directory=bf16, dtype="bfloat16"), timeout=120)
    from safetensors import safe_open
    with safe_open(os.path.join(bf16, "model.safetensors"), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    if dtypes != {torch.bfloat16}:
        raise Failure(f"the bfloat16 export holds {dtypes}")
    # A checkpoint of another shape is refused before anything is loaded: the session is intact.
    saved = c.training.SaveCheckpoint(c.pb.SaveCheckpointRequest(job=job), timeout=120)
    other = os.path.join(c.workdir, "other-shape")
    shutil.copytree(saved.directory, other)
    from safetensors.torch import load_file, save_file
    tensors = load_file(os.path.join(other, "model.safetensors"))
    name = sorted(k for k in tensors if k.endswith("mlp.down_proj.weight"))[-1]
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, os.path.join(other, "model.safetensors"), metadata={"format": "pt"})
    expect_code("load of a checkpoint of another shape",
                lambda: c.training.LoadCheckpoint(c.pb.LoadCheckpointRequest(job=job, directory=other), timeout=60),
                c.grpc.StatusCode.FAILED_PRECONDITION, "directory", name, "nothing was loaded")
    if max_diff(c.forward(job, probe), ours) > 1e-6:
        raise Failure("a refused load_checkpoint changed the session's weights")
    # Exporting again over an earlier export replaces it; over somebody's folder it refuses.
    c.training.ExportWeights(c.pb.ExportWeightsRequest(job=job, directory=export, dtype="float32"), timeout=120)
    foreign = os.path.join(c.workdir, "foreign")
    os.makedirs(foreign)
    open(os.path.join(foreign, "notes.txt"), "w").write("keep me")
    expect_code("export over a foreign folder",
                lambda: c.training.ExportWeights(c.pb.ExportWeightsRequest(job=job, directory=foreign), timeout=60),
                c.grpc.StatusCode.FAILED_PRECONDITION, "directory")
    check_sample(c, job, export)  # last: it trains (the export above holds the current weights)


def check_sample(c, job, export):
    """(i): Sample against transformers' greedy generate on the exported weights, seeds, order."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts = [[72, 101, 108, 108, 111], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [42]]
    greedy = c.sample(job, prompts, max_tokens=12, temperature=0)
    stop = greedy.sequences[0].tokens[4]  # a token greedy decoding emits: the stop rule acts
    first_stop = list(greedy.sequences[0].tokens).index(stop)
    greedy = c.sample(job, prompts, max_tokens=12, temperature=0, stop_tokens=[stop])
    model = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32)
    model.eval()
    for i, (p, seq) in enumerate(zip(prompts, greedy.sequences)):
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=stop,
                                 pad_token_id=stop, temperature=None, top_p=None, top_k=None)
        ref = out[0, len(p):].tolist()
        if list(seq.tokens) != ref:
            raise Failure(f"greedy Sample of prompt {i} gave {list(seq.tokens)}, transformers' generate {ref}")
        want_reason = "stop" if ref[-1] == stop else "length"
        if seq.prompt_index != i or seq.stop_reason != want_reason:
            raise Failure(f"sequence {i}: prompt_index {seq.prompt_index}, stop_reason {seq.stop_reason!r}")
    if greedy.sequences[0].stop_reason != "stop" or len(greedy.sequences[0].tokens) != first_stop + 1:
        raise Failure(f"the stop token {stop} did not end sequence 0: {list(greedy.sequences[0].tokens)}")
    # The sampled tokens' logprobs are Forward's (the sampler logprobs the RL losses compare).
    probe = [c.datum(p + list(q.tokens)) for p, q in zip(prompts, greedy.sequences)]
    fwd = c.forward(job, probe)
    worst = max(abs(a - b) for p, q, f in zip(prompts, greedy.sequences, fwd)
                for a, b in zip(q.logprobs, f[len(p) - 1:]))
    print(f"(i) greedy Sample = transformers' generate on {len(prompts)} prompts (stop token {stop}); "
          f"its logprobs vs Forward's: max |diff| = {worst:.1e}")
    if worst > 1e-4:
        raise Failure(f"Sample's logprobs differ from Forward's by {worst}")
    params = dict(max_tokens=10, temperature=1.0, top_k=50, top_p=0.95)
    a = c.sample(job, prompts[:2], n=3, seed=1234, **params)
    b = c.sample(job, prompts[:2], n=3, seed=1234, **params)
    other = c.sample(job, prompts[:2], n=3, seed=99, **params)
    toks = lambda r: [list(q.tokens) for q in r.sequences]  # noqa: E731
    if len(a.sequences) != 6 or [q.prompt_index for q in a.sequences] != [0, 0, 0, 1, 1, 1] or a.seed != 1234:
        raise Failure(f"seeded sample: {len(a.sequences)} sequences, seed {a.seed}")
    if toks(a) != toks(b) or toks(a) == toks(other):
        raise Failure(f"seed 1234 twice: {toks(a)} / {toks(b)}; seed 99: {toks(other)}")
    unseeded = c.sample(job, prompts[:1], max_tokens=4)
    print(f"    seed 1234 twice: the same {a.tokens} tokens, seed 99 others; unseeded drew seed {unseeded.seed}")
    # Ordered with the session's calls: after an optim_step the sample sees the new weights.
    before = c.sample(job, prompts[:1], max_tokens=8, temperature=0).sequences[0]
    c.fb(job, [c.datum(prompts[0] + [7] * 9)])
    c.step(job, lr=0.05)
    after = c.sample(job, prompts[:1], max_tokens=8, temperature=0).sequences[0]
    if list(after.logprobs) == list(before.logprobs):
        raise Failure("a Sample after an optim_step returned the logprobs of the weights before it")


def case_bad_input(c):
    c.start_controller()
    c.start_worker("w1")
    job = c.session()
    pb, INV = c.pb, c.grpc.StatusCode.INVALID_ARGUMENT
    good = c.batch(seed=5, n=2, length=9)
    toks = list(good[0].tokens) + [good[0].target_tokens[-1]]

    def fb(batch, kind="cross_entropy", **loss):
        return lambda: c.training.ForwardBackward(
            pb.ForwardBackwardRequest(job=job, batch=batch, loss=pb.LossConfig(kind=kind, **loss)), timeout=60)

    n = len(toks) - 1
    ones = [1.0] * n
    big = [c.datum([1] * (SEQ_LEN + 1)) for _ in range(BATCH_SIZE)] + [c.datum([1, 2])]
    table = [
        ("token id >= vocab", fb([good[0], c.datum([1, 2, 300, 4])]), "batch[1].tokens[2]", "[0, 256)"),
        ("token id < 0", fb([c.datum([-1, 2, 3])]), "batch[0].tokens[0]", "[0, 256)"),
        ("target_tokens length", fb([pb.Datum(tokens=[1, 2, 3], target_tokens=[2, 3])]), "batch[0].target_tokens",
         "length (2) must equal"),
        ("weights length", fb([c.datum(toks, weights=[1.0, 1.0])]), "batch[0].weights", "must equal"),
        ("NaN advantage", fb([c.datum(toks, sampler_logprobs=[-5.0] * n,
                                      advantages=[1.0, float("nan")] + [1.0] * (n - 2))], "importance_sampling"),
         "batch[0].advantages[1]", "finite"),
        ("inf sampler logprob", fb([c.datum(toks, sampler_logprobs=[-1.0] * n, advantages=ones),
                                    c.datum(toks, sampler_logprobs=[-1.0, -2.0, float("inf")] + [-1.0] * (n - 3),
                                            advantages=ones)], "ppo"),
         "batch[1].sampler_logprobs[2]", "finite"),
        ("unknown loss kind", fb(good, "dpo"), "loss.kind", "not a known loss"),
        ("ppo without sampler logprobs", fb([c.datum(toks, advantages=ones)], "ppo"), "batch[0].sampler_logprobs",
         "required by loss ppo"),
        ("ppo clip_low out of range", fb(good, "ppo", clip_low=1.5), "loss.clip_low", "(0, 1)"),
        ("batch over the planned size", fb(big), "batch:", f"limit of {SEQ_LEN * BATCH_SIZE}"),
        ("empty batch", fb([]), "batch:", "empty"),
        ("bad adam.lr", lambda: c.training.OptimStep(pb.OptimStepRequest(job=job, adam=pb.AdamWParams(lr=-1)),
                                                     timeout=60), "adam.lr", "in (0, 10]"),
        ("huge adam.lr", lambda: c.training.OptimStep(pb.OptimStepRequest(job=job, adam=pb.AdamWParams(lr=1e300)),
                                                      timeout=60), "adam.lr", "in (0, 10]"),
        ("NaN adam.beta1", lambda: c.training.OptimStep(
            pb.OptimStepRequest(job=job, adam=pb.AdamWParams(lr=1e-3, beta1=float("nan"))), timeout=60),
         "adam.beta1", "[0, 1)"),
        ("bad job name", lambda: c.training.Forward(pb.ForwardRequest(job="job/1", batch=good), timeout=60), "job:",
         "jobs/{id}"),
        ("relative load directory", lambda: c.training.LoadCheckpoint(
            pb.LoadCheckpointRequest(job=job, directory="ckpt/step-1"), timeout=60), "directory:", "absolute"),
        ("negative sequence", lambda: c.training.Forward(pb.ForwardRequest(job=job, batch=good, sequence=-3),
                                                         timeout=60), "sequence:", ">= 0"),
        ("sample without prompts", lambda: c.sample(job, []), "prompts:", "at least one prompt"),
        ("sample with an empty prompt", lambda: c.sample(job, [[1], []], max_tokens=2), "prompts[1]",
         "at least one token"),
        ("sample token id >= vocab", lambda: c.sample(job, [[1, 256]], max_tokens=2), "prompts[0][1]", "[0, 256)"),
        ("sample max_tokens 0", lambda: c.sample(job, [[1]]), "params.max_tokens", ">= 1"),
        ("sample past the positions", lambda: c.sample(job, [[1] * 10], max_tokens=4090), "prompts[0]",
         "max_position_embeddings"),
        ("sample over the planned size", lambda: c.sample(job, [[1, 2]], n=100, max_tokens=8), "prompts",
         f"limit of {SEQ_LEN * BATCH_SIZE} positions"),
        ("sample negative temperature", lambda: c.sample(job, [[1]], max_tokens=2, temperature=-1),
         "params.temperature", ">= 0"),
        ("sample NaN temperature", lambda: c.sample(job, [[1]], max_tokens=2, temperature=float("nan")),
         "params.temperature", "finite"),
        ("sample top_p > 1", lambda: c.sample(job, [[1]], max_tokens=2, top_p=1.5), "params.top_p", "(0, 1]"),
        ("sample negative top_k", lambda: c.sample(job, [[1]], max_tokens=2, top_k=-3), "params.top_k", ">= 0"),
        ("sample stop token >= vocab", lambda: c.sample(job, [[1]], max_tokens=2, stop_tokens=[5, 999]),
         "params.stop_tokens[1]", "[0, 256)"),
        ("sample negative num_samples", lambda: c.sample(job, [[1]], n=-2, max_tokens=2), "num_samples", ">= 1"),
        ("sample bad job name", lambda: c.training.Sample(pb.SampleRequest(job="jobs/x", prompts=[pb.SamplePrompt(
            tokens=[1])]), timeout=60), "job:", "jobs/{id}"),
    ]
    print(f"(e) {len(table)} bad requests:")
    for what, call, field, rule in table:
        expect_code(what, call, INV, field, rule)
    expect_code("optim_step before any forward_backward", lambda: c.step(job),
                c.grpc.StatusCode.FAILED_PRECONDITION, "forward_backward first")
    expect_code("unknown job", lambda: c.fb("jobs/999", good), c.grpc.StatusCode.NOT_FOUND, "jobs/999")
    # The session still trains.
    first = c.fb(job, good).loss
    if c.step(job).step != 1:
        raise Failure("optim_step after the bad requests did not return step 1")
    second = c.fb(job, good).loss
    print(f"    the session still trains: loss {first:.3f} -> {second:.3f}")
    # A sequenced call refused at the edge uses up its number: call 2 (sent first, so it waits
    # for 1) runs as soon as the bad call 1 is answered, not after the sequence wait.
    fb_good = pb.ForwardBackwardRequest(job=job, batch=good, loss=pb.LossConfig(kind="cross_entropy"), sequence=2)
    t0 = time.monotonic()
    second_call = c.training.ForwardBackward.future(fb_good, timeout=60)
    waiting = f'odyssey_training_calls_waiting{{job_id="{job.split("/")[-1]}"}}'
    wait_for("call 2 to wait for its turn on the controller", lambda: scrape(c.metrics_port).get(waiting) == 1,
             timeout=30)
    expect_code("sequenced call 1 with an unknown loss", lambda: c.training.ForwardBackward(
        pb.ForwardBackwardRequest(job=job, batch=good, loss=pb.LossConfig(kind="dpo"), sequence=1), timeout=60),
        INV, "loss.kind", "is not a known loss")
    second_call.result()
    waited = time.monotonic() - t0
    if waited > 10:
        raise Failure(f"sequenced call 2 waited {waited:.1f} s after the refused call 1")
    print(f"    a refused sequenced call 1 used up its number: call 2 answered after {waited:.1f} s")

    # (f) mismatch gauges on the controller's /metrics.
    logp = c.forward(job, good)
    shifted = [c.datum(list(d.tokens) + [d.target_tokens[-1]], sampler_logprobs=[x - 0.25 for x in lp],
                       advantages=[1.0] * len(lp)) for d, lp in zip(good, logp)]
    r = c.fb(job, shifted, "importance_sampling")
    if r.mismatch_tokens != 16 or abs(r.mismatch_mean - 0.25) > 1e-3 or abs(r.mismatch_max - 0.25) > 1e-3:
        raise Failure(f"mismatch of sampler logprobs 0.25 below the trainer's: {r.mismatch_mean} / {r.mismatch_max} "
                      f"over {r.mismatch_tokens} tokens")
    m = scrape(c.metrics_port)
    key = f'odyssey_rl_logprob_mismatch_mean{{job_id="{job.split("/")[-1]}"}}'
    print(f"(f) /metrics: {key} = {m.get(key)}, max = {m.get(key.replace('mean', 'max'))}")
    if abs(m.get(key, -1) - r.mismatch_mean) > 1e-9 or abs(m.get(key.replace("mean", "max"), -1) - r.mismatch_max) > 1e-9:
        raise Failure(f"the controller's mismatch gauges do not show the last forward_backward's: {m.get(key)}")
    calls = m.get('odyssey_training_calls_total{code="INVALID_ARGUMENT",method="ForwardBackward"}', 0)
    if calls < 10:
        raise Failure(f"odyssey_training_calls_total counted {calls} INVALID_ARGUMENT forward_backward calls")


def cli(c, *argv):
    out = subprocess.run([c.args.cli, "--controller", c.address, *argv], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise Failure(f"odyssey {' '.join(argv)} failed ({out.returncode}): {out.stdout}{out.stderr}")
    return out.stdout


def case_cancel(c):
    c.start_controller()
    c.start_worker("w1")
    batch = c.batch(seed=6)
    if c.args.cli:
        # The CLI creates a session from the example spec file (kind RL_SESSION, the rl block).
        example = os.path.join(c.args.source_dir, "client", "examples", "rl-session.yaml")
        job = re.search(r"jobs/\d+", cli(c, "submit", example)).group(0)
        c.wait_state(job, "RUNNING")
        spec = c.get(job).spec
        if spec.kind != c.pb.RL_SESSION or spec.rl.idle_timeout_seconds != 1800:
            raise Failure(f"the example spec arrived as {spec}")
    else:
        job = c.session()
    c.fb(job, batch)
    c.step(job)
    wait_for("GetJob to show step 1", lambda: c.get(job).step == 1, timeout=30)
    if c.args.cli:
        got = cli(c, "get", job)
        print(f"(h) odyssey get {job}:\n{got}")
        if "RL_SESSION" not in got or "step:            1 (optimizer steps" not in got:
            raise Failure(f"odyssey get shows {got!r}")
        cli(c, "cancel", job)
    else:
        c.jobs.CancelJob(c.pb.CancelJobRequest(name=job), timeout=10)
    c.wait_state(job, "CANCELLED")
    expect_code("a call after the cancel", lambda: c.fb(job, batch), c.grpc.StatusCode.FAILED_PRECONDITION,
                "is CANCELLED")
    # The worker is free again: a session with a short idle timeout ends SUCCEEDED on its own.
    idle = c.session(idle_timeout=2)
    c.fb(idle, batch)
    c.step(idle)
    t0 = time.monotonic()
    j = c.wait_state(idle, "SUCCEEDED", timeout=60)
    print(f"(h) {job} CANCELLED; {idle} idle-timed-out to SUCCEEDED after {time.monotonic() - t0:.1f}s at step {j.step}")
    if j.step != 1:
        raise Failure(f"the idle session ended at step {j.step}, want 1")
    expect_code("a call after the idle end", lambda: c.fb(idle, batch), c.grpc.StatusCode.FAILED_PRECONDITION,
                "is SUCCEEDED")


def case_worker_loss(c):
    c.start_controller()
    c.start_worker("w1")
    job = c.session(restart_limit=1)
    batch, probe = c.batch(seed=7), c.batch(seed=8, n=2, length=17)
    for _ in range(3):
        c.fb(job, batch)
        c.step(job)
    saved = c.training.SaveCheckpoint(c.pb.SaveCheckpointRequest(job=job), timeout=120)
    at_save = c.forward(job, probe)
    c.fb(job, batch)
    if c.step(job).step != 4:
        raise Failure("optim_step after the save")
    c.kill_worker("w1")
    wait_for("the controller to requeue the session", lambda: c.get(job).restarts == 1)
    expect_code("a call while the session waits for a worker", lambda: c.forward(job, probe),
                c.grpc.StatusCode.FAILED_PRECONDITION, "is PENDING")
    c.start_worker("w2")
    j = c.wait_state(job, "RUNNING")
    back = max_diff(c.forward(job, probe), at_save)
    c.fb(job, batch)
    step = c.step(job).step
    print(f"(worker loss) killed w1 at step 4; {job} restarted on {list(j.workers)} from {saved.directory}: "
          f"logprobs differ from save time by {back:.2e}, next optim_step is {step}")
    if list(j.workers) != ["w2"] or back > 1e-6 or step != saved.step + 1:
        raise Failure(f"the restarted session is not the saved one: workers {list(j.workers)}, diff {back}, step {step}")


def expect_trains_like_one_rank(c, single, multi, batch, probe_seed, what):
    """`multi` (a session of several ranks, its first forward_backward on `batch` already made, as
    on `single`) trains like the 1-rank `single`: 3 optim_step rounds (with 2 more
    forward_backwards of `batch`) give the same steps and grad norms (1e-4), forward on a probe
    batch then agrees within 1e-4, and its float32 ExportWeights loads in transformers and
    matches its forward (1e-4)."""
    for i in range(3):
        if i > 0:
            c.fb(single, batch)
            c.fb(multi, batch)
        s1, s2 = c.step(single), c.step(multi)
        if s1.step != i + 1 or s2.step != i + 1 or abs(s1.grad_norm - s2.grad_norm) > 1e-4 * max(1.0, s1.grad_norm):
            raise Failure(f"optim_step {i + 1}: step {s1.step} / {s2.step}, grad_norm {s1.grad_norm} / {s2.grad_norm}")
    probe = c.batch(seed=probe_seed, n=3, length=41) + [c.datum([7, 8, 9])]
    ours, theirs = c.forward(multi, probe), c.forward(single, probe)
    trained = max_diff(ours, theirs)
    print(f"after 3 rounds: forward max |diff| {trained:.2e} (grad_norm {s1.grad_norm:.4f} / {s2.grad_norm:.4f})")
    if trained > 1e-4:
        raise Failure(f"after 3 rounds {what}'s logprobs differ by {trained}")
    export = os.path.join(c.workdir, f"export-{multi.replace('/', '-')}")
    c.training.ExportWeights(c.pb.ExportWeightsRequest(job=multi, directory=export, dtype="float32"), timeout=120)
    worst = transformers_max_diff(export, probe, ours)
    print(f"ExportWeights of {what} vs its forward, in transformers: max |diff| {worst:.2e}")
    if worst > 1e-4:
        raise Failure(f"{what}'s export differs from its forward by {worst}")


def case_data_parallel(c):
    c.start_controller()
    for w in ("w1", "w2", "w3"):
        c.start_worker(w)
    single = c.session()
    dp = c.session(world_size=2)
    workers = list(c.get(dp).workers)
    print(f"1-rank session {single} on {list(c.get(single).workers)}; 2-rank session {dp} on {workers}")
    if len(workers) != 2:
        raise Failure(f"the 2-rank session runs on {workers}")
    # 5 datums of 32, 19, 40, 11 and 26 tokens: the controller cuts after datum 1 (51 of 128 tokens),
    # so rank 1 runs datums 2..4. Datum 1 carries weights (W = 32 + 19 x 0.5 + 40 + 11 + 26).
    rng = random.Random(11)
    batch = [c.datum([rng.randrange(VOCAB) for _ in range(n + 1)]) for n in (32, 19, 40, 11, 26)]
    batch[1].weights.extend([0.5] * 19)
    a, b = c.fb(single, batch), c.fb(dp, batch)
    lp_diff = max_diff([l.values for l in a.logprobs], [l.values for l in b.logprobs])
    print(f"forward_backward: loss {a.loss:.6f} (1 rank) vs {b.loss:.6f} (2 ranks), W {a.weight_sum} vs "
          f"{b.weight_sum}, logprobs max |diff| {lp_diff:.2e}")
    if len(b.logprobs) != 5 or [len(l.values) for l in b.logprobs] != [32, 19, 40, 11, 26]:
        raise Failure(f"the 2-rank reply holds logprob rows of {[len(l.values) for l in b.logprobs]} tokens")
    if lp_diff > 1e-5 or abs(a.loss - b.loss) > 1e-5 or abs(a.weight_sum - b.weight_sum) > 1e-9 or b.tokens != 128:
        raise Failure(f"the 2-rank forward_backward differs: loss {b.loss} vs {a.loss}, W {b.weight_sum} vs "
                      f"{a.weight_sum}, tokens {b.tokens}, logprobs {lp_diff}")
    expect_trains_like_one_rank(c, single, dp, batch, probe_seed=12, what="the 2-rank session")

    bad = list(batch)
    bad[3] = c.datum([1, 2, 300, 4] + [5] * 8)  # 11 tokens like the datum it replaces: still rank 1's
    msg = expect_code("a bad datum in rank 1's slice", lambda: c.fb(dp, bad), c.grpc.StatusCode.INVALID_ARGUMENT,
                      "batch[3].tokens[2]", "[0, 256)")
    if "another rank" in msg:
        raise Failure(f"the error is another rank's echo, not the bad datum's: {msg}")
    # A NaN weight makes W NaN: the controller leaves W to the engine, which names the weight.
    bad[3] = c.datum(list(batch[3].tokens) + [batch[3].target_tokens[-1]],
                     weights=[1.0, float("nan")] + [1.0] * (len(batch[3].tokens) - 2))
    expect_code("a NaN weight in rank 1's slice", lambda: c.fb(dp, bad), c.grpc.StatusCode.INVALID_ARGUMENT,
                "batch[3].weights[1]")
    c.fb(dp, batch)
    step = c.step(dp).step
    print(f"the 2-rank session still trains after the refused batch: optim_step {step}")
    if step != 4:
        raise Failure(f"optim_step after the refused batch returned step {step}, want 4")


def case_context_parallel(c):
    c.start_controller()
    for w in ("w1", "w2", "w3"):
        c.start_worker(w)
    single = c.session()
    cp = c.session(world_size=2, context_parallel=2)
    workers = list(c.get(cp).workers)
    print(f"1-rank session {single} on {list(c.get(single).workers)}; context-parallel session {cp} on {workers}")
    if len(workers) != 2:
        raise Failure(f"the context-parallel session runs on {workers}")
    # Odd lengths (each padded to a multiple of 2, the padding on rank 1), one datum shorter than
    # rank 1's first position, a prompt outside the loss, sampler logprobs and advantages for ppo.
    rng = random.Random(21)
    batch = []
    for n in (33, 19, 3, 41, 26):
        batch.append(c.datum([rng.randrange(VOCAB) for _ in range(n + 1)],
                             weights=[0.0] * 2 + [0.5 + rng.random() for _ in range(n - 2)],
                             sampler_logprobs=[-6.0 + rng.random() for _ in range(n)],
                             advantages=[2 * rng.random() - 1 for _ in range(n)]))
    lengths = [len(d.tokens) for d in batch]
    for kind in ("cross_entropy", "ppo"):
        a, b = c.fb(single, batch, kind), c.fb(cp, batch, kind)
        lp_diff = max_diff([l.values for l in a.logprobs], [l.values for l in b.logprobs])
        print(f"forward_backward {kind}: loss {a.loss:.6f} (1 rank) vs {b.loss:.6f} (CP 2), logprobs max |diff| "
              f"{lp_diff:.2e}, mismatch {a.mismatch_mean:.6f} / {b.mismatch_mean:.6f}, clipped {a.clipped_tokens} / "
              f"{b.clipped_tokens}")
        if [len(l.values) for l in b.logprobs] != lengths:
            raise Failure(f"the CP reply holds logprob rows of {[len(l.values) for l in b.logprobs]} tokens, "
                          f"want {lengths}")
        if (lp_diff > 1e-5 or abs(a.loss - b.loss) > 1e-5 * max(1.0, abs(a.loss))
                or abs(a.weight_sum - b.weight_sum) > 1e-9 or b.tokens != sum(lengths)
                or a.mismatch_tokens != b.mismatch_tokens or abs(a.mismatch_mean - b.mismatch_mean) > 1e-5
                or a.clipped_tokens != b.clipped_tokens):
            raise Failure(f"the CP forward_backward ({kind}) differs: loss {b.loss} vs {a.loss}, W {b.weight_sum} vs "
                          f"{a.weight_sum}, tokens {b.tokens}, logprobs {lp_diff}, mismatch {b.mismatch_mean} vs "
                          f"{a.mismatch_mean}, clipped {b.clipped_tokens} vs {a.clipped_tokens}")
    expect_trains_like_one_rank(c, single, cp, batch, probe_seed=22, what="the CP session")

    bad = list(batch)
    bad[3] = c.datum([1, 2, 300, 4] + [5] * 8)
    msg = expect_code("a bad datum", lambda: c.fb(cp, bad), c.grpc.StatusCode.INVALID_ARGUMENT, "batch[3].tokens[2]",
                      "[0, 256)")
    if "another rank" in msg:
        raise Failure(f"the error is another rank's echo, not the bad datum's: {msg}")
    expect_code("Sample", lambda: c.sample(cp, [[1, 2, 3]], max_tokens=4), c.grpc.StatusCode.UNIMPLEMENTED,
                "context_parallel")
    # seq_len x batch_size (256) bounds the whole batch: each rank plans for half of it.
    big = [c.datum([1] * (SEQ_LEN + 1)) for _ in range(BATCH_SIZE)] + [c.datum([1, 2])]
    expect_code("a batch over the limit", lambda: c.fb(cp, big), c.grpc.StatusCode.INVALID_ARGUMENT,
                "257 token positions exceed the session's limit of 256", "parallel.context_parallel 2")
    c.fb(cp, batch)
    step = c.step(cp).step
    print(f"the CP session still trains after the refused calls: optim_step {step}")
    if step != 4:
        raise Failure(f"optim_step after the refused calls returned step {step}, want 4")


def case_dp_over_cp(c):
    c.start_controller()
    for w in ("w1", "w2", "w3", "w4", "w5"):
        c.start_worker(w)
    single = c.session()
    multi = c.session(world_size=4, context_parallel=2)
    workers = list(c.get(multi).workers)
    print(f"1-rank session {single}; 2 x context-parallel-2 session {multi} on {workers}")
    if len(workers) != 4:
        raise Failure(f"the 2 x CP 2 session runs on {workers}")
    # Two context-parallel groups, each one slice: the controller cuts after datum 2 (63 of 130
    # tokens), odd lengths are padded per group.
    rng = random.Random(31)
    batch = [c.datum([rng.randrange(VOCAB) for _ in range(n + 1)],
                     weights=[0.5 + rng.random() for _ in range(n)],
                     sampler_logprobs=[-6.0 + rng.random() for _ in range(n)],
                     advantages=[2 * rng.random() - 1 for _ in range(n)])
             for n in (33, 19, 11, 41, 26)]
    # cross_entropy: ppo's clipped tokens leave many parameters a near-zero gradient, which
    # AdamW turns into lr-sized updates of either sign, so 3 rounds would compare rounding noise
    # (ppo under context parallelism: ContextParallelTest.Rl*, and the context_parallel case).
    a, b = c.fb(single, batch), c.fb(multi, batch)
    lp_diff = max_diff([l.values for l in a.logprobs], [l.values for l in b.logprobs])
    print(f"forward_backward cross_entropy: loss {a.loss:.6f} (1 rank) vs {b.loss:.6f} (2 x CP 2), logprobs max |diff| "
          f"{lp_diff:.2e}, clipped {a.clipped_tokens} / {b.clipped_tokens}, tokens {a.tokens} / {b.tokens}")
    if ([len(l.values) for l in b.logprobs] != [len(d.tokens) for d in batch] or lp_diff > 1e-5
            or abs(a.loss - b.loss) > 1e-5 * max(1.0, abs(a.loss)) or a.clipped_tokens != b.clipped_tokens
            or a.tokens != b.tokens or a.mismatch_tokens != b.mismatch_tokens):
        raise Failure(f"the 2 x CP 2 forward_backward differs: loss {b.loss} vs {a.loss}, logprobs {lp_diff}, "
                      f"clipped {b.clipped_tokens} vs {a.clipped_tokens}, tokens {b.tokens} vs {a.tokens}")
    expect_trains_like_one_rank(c, single, multi, batch, probe_seed=32, what="the 2 x CP 2 session")
    bad = list(batch)
    bad[4] = c.datum([1, 2, 300, 4] + [5] * 22)  # 26 tokens like the datum it replaces: group 1's
    msg = expect_code("a bad datum in group 1's slice", lambda: c.fb(multi, bad), c.grpc.StatusCode.INVALID_ARGUMENT,
                      "batch[4].tokens[2]", "[0, 256)")
    if "another rank" in msg:
        raise Failure(f"the error is another rank's echo, not the bad datum's: {msg}")


def main():
    ap = arg_parser(cli="the odyssey CLI (the cancel case submits the example spec with it)")
    ap.add_argument("--case", required=True, choices=["train", "hf_parity", "bad_input", "cancel", "worker_loss",
                                                          "data_parallel", "context_parallel", "dp_over_cp"])
    args = parse_args(ap)
    outcome = run_test(f"rl {args.case}", f"odyssey-rl-{args.case}-", args.keep, lambda workdir: RlCluster(args, workdir),
                       lambda c: globals()[f"case_{args.case}"](c))
    return 0 if outcome == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
