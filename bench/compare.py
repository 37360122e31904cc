#!/usr/bin/env python3
"""Side-by-side table of odyssey-bench and a peer (bench/hf_bench.py) from the JSON lines both
wrote in the same run on the GPU host: per sequence length, tokens/s and GPU peak of each and
odyssey's ratio to the peer (speed: higher is better; memory: lower is better).

  python3 bench/compare.py out/bench.jsonl out/hf.jsonl
"""
import json
import sys


def load(path):
    rows = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    rows.append(json.loads(line))
    except FileNotFoundError:
        pass
    return rows


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: compare.py ODYSSEY_JSONL PEER_JSONL")
    ours, peers = load(sys.argv[1]), load(sys.argv[2])
    gib = float(1 << 30)
    print("| seq | peer | peer tok/s | peer GPU peak GiB | odyssey memory | odyssey tok/s | odyssey GPU peak GiB "
          "| speed ratio | memory ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in peers:
        s = p["seq_len"]
        if p.get("oom"):
            print(f"| {s} | {p['impl']} | out of memory | | | | | | |")
            continue
        for o in [o for o in ours if o["seq_len"] == s and o.get("layers") == p.get("layers")]:
            print(f"| {s} | {p['impl']} | {p['tokens_per_second']:.0f} | {p['gpu_peak_allocated_bytes'] / gib:.1f} "
                  f"| {o['memory']}{'' if o.get('fused_kernels', True) else ' (reference ops)'} "
                  f"| {o['tokens_per_second']:.0f} | {o['gpu_peak_allocated_bytes'] / gib:.1f} "
                  f"| {o['tokens_per_second'] / p['tokens_per_second']:.2f}x "
                  f"| {o['gpu_peak_allocated_bytes'] / p['gpu_peak_allocated_bytes']:.2f}x |")


if __name__ == "__main__":
    main()
