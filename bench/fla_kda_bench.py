#!/usr/bin/env python3
"""The peer of odyssey-hybrid-bench's KDA rows: flash-linear-attention's Triton chunk_kda
(fla-core 0.6.0, fla.ops.kda.chunk_kda) on the same shapes and inputs: one sequence of T tokens,
24 heads of 128 (hybrid-3b's KDA layer), bf16 q, k (L2-normalised), v, beta = sigmoid(.), float32
log-decay g = logsigmoid(x + 4) (--gate mild) or -5 sigmoid(x) (--gate strong). Times the forward and forward + backward (one warm-up, then
--iters timed calls) and prints table rows and JSON lines.

  python3 bench/fla_kda_bench.py --tokens 65536 262144 --json out/fla.jsonl

fla-core is a benchmark peer, not a dependency: install it where the benchmark runs.
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F


def seconds(fn, iters):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[65536, 262144])
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--gate", choices=["mild", "strong"], default="mild",
                   help="log-decay: mild = logsigmoid(x + 4), strong = -5 sigmoid(x) (odyssey-hybrid-bench's --gate)")
    a = p.parse_args()
    from fla.ops.kda import chunk_kda

    torch.manual_seed(0)
    for T in a.tokens:
        dev = "cuda"
        shape = (1, T, a.heads, a.dim)  # fla's [B, T, H, K]
        q = F.normalize(torch.randn(shape, device=dev, dtype=torch.bfloat16), dim=-1).requires_grad_()
        k = F.normalize(torch.randn(shape, device=dev, dtype=torch.bfloat16), dim=-1).requires_grad_()
        v = torch.randn(shape, device=dev, dtype=torch.bfloat16).requires_grad_()
        x = torch.randn(shape, device=dev, dtype=torch.float32)
        g = (F.logsigmoid(x + 4.0) if a.gate == "mild" else -5.0 * torch.sigmoid(x)).requires_grad_()
        beta = torch.sigmoid(torch.randn((1, T, a.heads), device=dev, dtype=torch.bfloat16)).requires_grad_()
        dout = torch.randn(shape, device=dev, dtype=torch.bfloat16)

        def forward():
            with torch.no_grad():
                chunk_kda(q, k, v, g, beta)

        def both():
            o, _ = chunk_kda(q, k, v, g, beta)
            o.backward(dout)
            for t in (q, k, v, g, beta):
                t.grad = None

        fwd = seconds(forward, a.iters)
        fb = seconds(both, a.iters)
        print(f"| KDA chunk_kda (fla-core, Triton), {a.gate} gate | {T} | {fwd * 1e3:.1f} | {fb * 1e3:.1f} | {T / fb:.0f} | |", flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps({"op": "fla_chunk_kda", "gate": a.gate, "tokens": T, "heads": a.heads, "dim": a.dim,
                                    "forward_ms": fwd * 1e3, "forward_backward_ms": fb * 1e3}) + "\n")
        del q, k, v, g, beta, dout
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
