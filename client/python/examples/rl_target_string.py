#!/usr/bin/env python3
"""RL on odyssey's embedded default: teach the `tiny` byte-level model (CPU) to answer a fixed
prompt with a target string, the way an RL orchestrator drives a trainer.

The loop is asyncio code over odyssey_client's Tinker-style clients (ServiceClient ->
TrainingClient -> SamplingClient); every call is awaited. Each iteration:
  1. Sample: the session's worker samples a group of completions of the prompt from its current
     weights (KV-cache decoding, temperature 1, seeded per step), one byte per token, with the
     logprob of each sampled token;
  2. reward = bytes of the completion equal to the target at the same position; advantages
     against the group (GRPO-style): per token, its match minus the group's mean match at that
     position (`--advantage token`, the default: a byte is not credited for its neighbours' luck),
     or the completion's reward minus the group's mean reward (`--advantage sequence`);
  3. ForwardBackward with the PPO (or importance-sampling) loss over the sampler's logprobs,
     then OptimStep, pipelined: both are sent before either reply is read.

It prints the mean reward of every step and the trainer-vs-sampler logprob mismatch (the same
weights, the decoding path with its KV cache against the training forward: expect ~1e-6 in
float32), and at the end the greedy completion (a Sample at temperature 0). The final weights
are exported (ExportWeights, a Hugging Face folder) into --workdir for an external inference
engine such as vLLM. Deterministic for a seed. Without an entropy or KL term the model tends to
settle on one byte for the positions it has not yet told apart, and then stops exploring them:
a learned byte spreads to the neighbouring positions faster than the group's baseline can push
it back.

    python client/python/examples/rl_target_string.py --controller 127.0.0.1:50051 --steps 30

Needs odyssey_client (pip install ./client/python) and torch.
"""
import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import torch

from odyssey_client import Datum, SamplingParams, ServiceClient


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--controller", default=os.environ.get("ODYSSEY_CONTROLLER", "127.0.0.1:50051"),
                   help="controller address host:port (default: $ODYSSEY_CONTROLLER or 127.0.0.1:50051)")
    p.add_argument("--token", default=os.environ.get("ODYSSEY_TOKEN"), help="bearer token (default: $ODYSSEY_TOKEN)")
    p.add_argument("--tls-ca", help="CA certificate (PEM) of the controller: turns TLS on")
    p.add_argument("--tls-server-name", help="name to check the controller's certificate against")
    p.add_argument("--tls-cert", help="client certificate (PEM) for a controller that requires mutual TLS")
    p.add_argument("--tls-key", help="key (PEM) of --tls-cert")
    p.add_argument("--steps", type=int, default=30, help="RL iterations (default 30)")
    p.add_argument("--seed", type=int, default=1, help="seeds the model's initialization and the sampler")
    p.add_argument("--prompt", default="Q: greet\nA: ", help="the fixed prompt")
    p.add_argument("--target", default="hi!", help="the string the reward asks for (2-4 bytes learn quickly)")
    p.add_argument("--group-size", type=int, default=64, help="completions sampled per step")
    p.add_argument("--lr", type=float, default=5e-3, help="AdamW learning rate")
    p.add_argument("--loss", choices=["ppo", "importance_sampling"], default="ppo")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip range (both sides)")
    p.add_argument("--advantage", choices=["token", "sequence"], default="token")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="the session's dtype (sampling decodes in it too)")
    p.add_argument("--world-size", type=int, default=1,
                   help="workers the session runs on, data parallel (the controller needs that many free workers)")
    p.add_argument("--workdir", help="where the final weights are exported (default: a temporary directory); it "
                   "must be writable by the worker")
    p.add_argument("--report", help="write the per-step numbers to this JSON file")
    p.add_argument("--keep-session", action="store_true", help="leave the session running at the end")
    args = p.parse_args(argv)
    if args.steps < 1 or args.group_size < 2:
        p.error("--steps must be >= 1 and --group-size >= 2 (the advantages are relative to the group)")
    return args


def advantages(match: torch.Tensor, kind: str) -> torch.Tensor:
    """match (n, L) of 0/1: per-token advantages (n, L)."""
    if kind == "token":
        return match - match.mean(0, keepdim=True)
    reward = match.sum(1, keepdim=True)  # (n, 1)
    return (reward - reward.mean()).expand_as(match)


async def run(args, prompt, target, weights_dir):
    """The RL loop; returns (history, greedy completion, export folder)."""
    L = len(target)
    service = ServiceClient(args.controller, token=args.token, tls_ca=args.tls_ca,
                            tls_server_name=args.tls_server_name, tls_cert=args.tls_cert, tls_key=args.tls_key)
    t0 = time.monotonic()
    training = await service.create_training_client_async(
        base_model="tiny", dtype=args.dtype, world_size=args.world_size, seq_len=len(prompt) + L,
        batch_size=args.group_size, idle_timeout_seconds=600, seed=args.seed, display_name="rl_target_string")
    print(f"{training.name} RUNNING after {time.monotonic() - t0:.1f}s; prompt {args.prompt!r}, target {args.target!r}, "
          f"group {args.group_size}, {args.loss}, lr {args.lr}")
    sampler = training.create_sampling_client()
    history = []
    target_t = torch.tensor(target).unsqueeze(0)  # (1, L)
    try:
        for step in range(1, args.steps + 1):
            ts = time.monotonic()
            # No stop token: every completion has L tokens. One seed per step: reproducible.
            params = SamplingParams(max_tokens=L, temperature=1.0, seed=args.seed * 100003 + step)
            res = await sampler.sample(prompt, num_samples=args.group_size, sampling_params=params)
            completions = torch.tensor([s.tokens for s in res.sequences], dtype=torch.int64)      # (n, L)
            sampler_logp = torch.tensor([s.logprobs for s in res.sequences], dtype=torch.float32)  # (n, L)
            match = (completions == target_t).float()                                           # (n, L)
            reward = match.sum(1)                                                               # (n,)
            adv = advantages(match, args.advantage)
            batch = [Datum.from_completion(prompt, completions[i], sampler_logp[i], adv[i])
                     for i in range(args.group_size)]
            fb_future = training.forward_backward(batch, loss=args.loss, clip_low=args.clip, clip_high=args.clip)
            step_future = training.optim_step(lr=args.lr, weight_decay=0.0)  # pipelined behind it
            fb, opt = await fb_future, await step_future
            row = {"step": opt.step, "reward": reward.mean().item(), "reward_max": reward.max().item(),
                   "loss": fb.loss, "mismatch_mean": fb.mismatch_mean, "mismatch_max": fb.mismatch_max,
                   "mismatch_tokens": fb.mismatch_tokens,
                   "clipped_tokens": fb.clipped_tokens, "grad_norm": opt.grad_norm,
                   "seconds": time.monotonic() - ts}
            history.append(row)
            print(f"step {row['step']:3d}  reward {row['reward']:.3f}/{L} (max {row['reward_max']:.0f})  "
                  f"loss {fb.loss:+.4f}  mismatch mean {fb.mismatch_mean:.1e} max {fb.mismatch_max:.1e}  "
                  f"clipped {fb.clipped_tokens}  |g| {opt.grad_norm:.3f}  {row['seconds']:.2f}s", flush=True)
        best = await sampler.sample(prompt, sampling_params=SamplingParams(max_tokens=L, temperature=0))
        greedy = bytes(best.sequences[0].tokens)
        exported = await training.export_weights(weights_dir)  # for vLLM / transformers
    finally:
        if not args.keep_session:
            await training.close_async()
        service.close()
    return history, greedy, exported


def main(argv=None) -> int:
    args = parse_args(argv)
    prompt = list(args.prompt.encode())
    target = list(args.target.encode())
    L = len(target)
    if not prompt or not target:
        sys.exit("--prompt and --target must be non-empty")
    if args.world_size < 1:
        sys.exit("--world-size must be >= 1")
    workdir = args.workdir or tempfile.mkdtemp(prefix="odyssey-rl-")
    weights_dir = os.path.join(os.path.abspath(workdir), "weights")
    history, greedy, exported = asyncio.run(run(args, prompt, target, weights_dir))
    k = max(1, min(5, len(history) // 3))
    first = sum(r["reward"] for r in history[:k]) / k
    last = sum(r["reward"] for r in history[-k:]) / k
    print(f"mean reward of the first {k} steps {first:.3f}, last {k} {last:.3f} (of {L} bytes); "
          f"greedy completion {greedy!r}; max mismatch {max(r['mismatch_max'] for r in history):.1e}; "
          f"final weights exported to {exported}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"target": args.target, "first": first, "last": last, "window": k, "greedy": greedy.decode("latin-1"),
                       "export": exported, "steps": history}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
