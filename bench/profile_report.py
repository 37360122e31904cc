#!/usr/bin/env python3
"""Summarizes one profiled odyssey step (odyssey-bench --profile DIR wrote DIR/trace.json):

- time per phase: the engine's scopes ("layer N forward|recompute|backward", "loss", "loss
  backward", "optimizer") on the GPU timeline (on the CPU's for a CPU run), summed over layers;
- GPU kernel time by kind (matmul, attention, odyssey's kernels, other elementwise/reduction,
  copies) and the 12 costliest kernels;
- host <-> device copies: bytes, time and how much of it overlapped kernels;
- the memory timeline (allocated and reserved after every allocation) and the phase its peak
  fell in;
- what is alive at the peak: the allocations not yet freed at that instant, grouped by the op
  that made them (the innermost op around the allocation that is not a bare allocation such as
  aten::empty) and the phase it ran in, largest first.

Writes DIR/profile.json and, where matplotlib is installed, DIR/memory.png (memory over the
step, phases shaded); prints the tables as markdown.

  python3 bench/profile_report.py out/profile/trace.json
"""
import argparse
import bisect
import heapq
import json
import os
import re
from collections import defaultdict

KINDS = [
    ("odyssey kernels", re.compile(r"odyssey")),
    ("attention", re.compile(r"flash|fmha|cudnn|sdpa|attn|attention", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|sm90_|matmul", re.I)),
    ("copy / fill", re.compile(r"copy|memcpy|memset|fill|cat_|CatArray", re.I)),
    ("reduction", re.compile(r"reduce|norm|sum|softmax|logsumexp", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise", re.I)),
]


ALLOC_OPS = re.compile(r"^aten::(empty|empty_strided|empty_like|new_empty|new_empty_strided|resize_|zeros|"
                       r"zeros_like|full|ones|ones_like)$")


def live_at_peak(events, mem, peak, phases):
    """The allocations of `mem` alive at `peak` (a [memory] event), grouped by (phase, op): the
    innermost CPU op on the allocating thread around each allocation, bare allocations (aten::empty
    and kin) skipped so the op that asked for the memory names it. Returns [(bytes, count, phase,
    op)], largest first."""
    live = {}
    for e in mem:
        a = e["args"]
        if a["Bytes"] > 0:
            live[a["Addr"]] = e
        else:
            live.pop(a["Addr"], None)
        if e is peak:
            break
    ops = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            ops[e.get("tid")].append(e)
    starts = {}
    for tid, lst in ops.items():
        lst.sort(key=lambda e: e["ts"])
        starts[tid] = [e["ts"] for e in lst]
    phase_list = sorted(phases, key=lambda p: p["ts"])
    phase_starts = [p["ts"] for p in phase_list]

    def innermost(lst, st, t, skip):
        i = bisect.bisect_right(st, t) - 1
        # Scanning back from the last op begun by t, the first one still running at t is the
        # innermost (scopes nest); a window bounds the scan.
        for j in range(i, max(-1, i - 4000), -1):
            e = lst[j]
            if e["ts"] <= t <= e["ts"] + e.get("dur", 0) and not (skip and skip.match(e["name"])):
                return e
        return None

    groups = defaultdict(lambda: [0, 0])
    for e in live.values():
        t, tid = e["ts"], e.get("tid")
        op = innermost(ops.get(tid, []), starts.get(tid, []), t, ALLOC_OPS) if tid in ops else None
        ph = innermost(phase_list, phase_starts, t, None)
        key = (ph["name"] if ph else "outside every phase", op["name"] if op else "?")
        groups[key][0] += e["args"]["Bytes"]
        groups[key][1] += 1
    return sorted(((b, c, k[0], k[1]) for k, (b, c) in groups.items()), reverse=True)


def kind_of(name):
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def union(intervals):
    out = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def overlap(a, b):
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def phase_kind(name):
    m = re.match(r"layers? [\d-]+ (forward|recompute|backward)$", name)
    return f"layers {m.group(1)}" if m else name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--device-id", type=int, default=None, help="memory of this device (default: CUDA 0, or the CPU)")
    args = ap.parse_args()
    out_dir = os.path.dirname(os.path.abspath(args.trace))
    with open(args.trace) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    gpu = bool(kernels)
    ann_cat = "gpu_user_annotation" if gpu else "user_annotation"
    phases = [e for e in events if e.get("cat") == ann_cat and "dur" in e]
    cpu_phases = [e for e in events if e.get("cat") == "user_annotation" and "dur" in e]
    timeline = kernels if gpu else [e for e in events if e.get("cat") == "cpu_op" and "dur" in e]
    t0 = min(e["ts"] for e in timeline + phases)
    t1 = max(e["ts"] + e["dur"] for e in timeline + phases)
    report = {"step_seconds": (t1 - t0) / 1e6, "timeline": "gpu" if gpu else "cpu"}

    by_phase = defaultdict(float)
    per_layer = defaultdict(lambda: defaultdict(float))
    for e in phases:
        by_phase[phase_kind(e["name"])] += e["dur"] / 1e6
        m = re.match(r"layers? ([\d-]+) (forward|recompute|backward)$", e["name"])
        if m:
            per_layer[m.group(1)][m.group(2)] += e["dur"] / 1e6
    report["phases_seconds"] = dict(sorted(by_phase.items(), key=lambda kv: -kv[1]))
    report["per_layer_seconds"] = {k: dict(v) for k, v in per_layer.items()}

    if gpu:
        by_kind = defaultdict(float)
        by_name = defaultdict(lambda: [0.0, 0])
        for e in kernels:
            by_kind[kind_of(e["name"])] += e["dur"] / 1e6
            by_name[e["name"]][0] += e["dur"] / 1e6
            by_name[e["name"]][1] += 1
        busy = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
        report["kernel_seconds_by_kind"] = dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))
        report["gpu_busy_seconds"] = sum(e - s for s, e in busy) / 1e6
        report["top_kernels"] = [
            {"name": n[:160], "seconds": t, "calls": c}
            for n, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:12]
        ]
        copies = [e for e in events if e.get("cat") == "gpu_memcpy" and "dur" in e]
        copy_report = {}
        for direction in ("HtoD", "DtoH", "DtoD"):
            cs = [e for e in copies if direction in e["name"]]
            if not cs:
                continue
            spans = union([(e["ts"], e["ts"] + e["dur"]) for e in cs])
            total = sum(e - s for s, e in spans)
            copy_report[direction] = {
                "bytes": sum(e.get("args", {}).get("bytes", 0) for e in cs),
                "seconds": total / 1e6,
                "overlapped_with_kernels": overlap(spans, busy) / total if total else 0.0,
            }
        report["copies"] = copy_report

    device = args.device_id if args.device_id is not None else (0 if gpu else -1)
    mem = [e for e in events if e.get("name") == "[memory]" and e.get("args", {}).get("Device Id") == device]
    mem.sort(key=lambda e: e["ts"])
    if mem:
        peak = max(mem, key=lambda e: e["args"]["Total Allocated"])
        inside = [p for p in cpu_phases if p["ts"] <= peak["ts"] <= p["ts"] + p["dur"]]
        innermost = min(inside, key=lambda p: p["dur"])["name"] if inside else "outside every phase"
        report["memory"] = {
            "device_id": device,
            "peak_allocated_bytes": peak["args"]["Total Allocated"],
            "peak_reserved_bytes": max(e["args"]["Total Reserved"] for e in mem),
            "peak_phase": innermost,
            "allocations": len(mem),
        }
        # The highest allocation in each phase (innermost scope; layers grouped by kind as well):
        # what the planner's phase model predicts term by term.
        # One sweep in time order (a step at length has ~10^6 allocations and ~10^4 phases):
        # the phases begun so far in a heap by duration, the shortest one not yet ended on top.
        by_name, by_kind = {}, {}
        starts = sorted(cpu_phases, key=lambda p: p["ts"])
        begun, nxt = [], 0
        for e in mem:
            while nxt < len(starts) and starts[nxt]["ts"] <= e["ts"]:
                p = starts[nxt]
                heapq.heappush(begun, (p["dur"], nxt, p))
                nxt += 1
            while begun and begun[0][2]["ts"] + begun[0][2]["dur"] < e["ts"]:
                heapq.heappop(begun)
            name = begun[0][2]["name"] if begun else "outside every phase"
            a = e["args"]["Total Allocated"]
            by_name[name] = max(by_name.get(name, 0), a)
            by_kind[phase_kind(name)] = max(by_kind.get(phase_kind(name), 0), a)
        report["memory"]["live_at_peak"] = [
            {"bytes": b, "allocations": c, "phase": ph, "op": op}
            for b, c, ph, op in live_at_peak(events, mem, peak, cpu_phases)[:40]
        ]
        report["memory"]["peak_by_phase_kind"] = dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))
        report["memory"]["peak_by_phase"] = dict(sorted(by_name.items(), key=lambda kv: -kv[1]))
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
            c0 = mem[0]["ts"]
            ts = [(e["ts"] - c0) / 1e6 for e in mem]
            gib = float(1 << 30)
            fig, ax = plt.subplots(figsize=(12, 4.5))
            colors = {"forward": "#cfe3f7", "recompute": "#f7e3cf", "backward": "#f7cfcf"}
            for p in cpu_phases:
                m = re.match(r"layers? [\d-]+ (forward|recompute|backward)$", p["name"])
                if m:
                    ax.axvspan((p["ts"] - c0) / 1e6, (p["ts"] + p["dur"] - c0) / 1e6, color=colors[m.group(1)],
                               lw=0)
            ax.plot(ts, [e["args"]["Total Allocated"] / gib for e in mem], lw=0.8, label="allocated")
            ax.plot(ts, [e["args"]["Total Reserved"] / gib for e in mem], lw=0.8, label="reserved")
            ax.axhline(peak["args"]["Total Allocated"] / gib, color="k", lw=0.5, ls=":")
            ax.set_xlabel("host time in the step (s); shading: layer forward (blue), recompute (orange), "
                          "backward (red)")
            ax.set_ylabel("GiB")
            ax.set_title(f"memory over one step; peak {peak['args']['Total Allocated'] / gib:.1f} GiB in "
                         f"'{innermost}'")
            ax.legend(loc="upper right")
            fig.tight_layout()
            fig.savefig(os.path.join(out_dir, "memory.png"), dpi=110)
            report["memory"]["plot"] = os.path.join(out_dir, "memory.png")
        except ImportError:
            pass

    with open(os.path.join(out_dir, "profile.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"step: {report['step_seconds']:.3f} s on the {report['timeline']} timeline")
    print("| phase | seconds |\n| --- | --- |")
    for k, v in report["phases_seconds"].items():
        print(f"| {k} | {v:.3f} |")
    if gpu:
        print(f"\nGPU busy {report['gpu_busy_seconds']:.3f} s of {report['step_seconds']:.3f} s")
        print("| kernel kind | seconds | share of busy |\n| --- | --- | --- |")
        for k, v in report["kernel_seconds_by_kind"].items():
            print(f"| {k} | {v:.3f} | {100 * v / report['gpu_busy_seconds']:.1f}% |")
        print("| top kernel | calls | seconds |\n| --- | --- | --- |")
        for k in report["top_kernels"]:
            print(f"| {k['name'][:90]} | {k['calls']} | {k['seconds']:.3f} |")
        for d, c in report["copies"].items():
            print(f"copies {d}: {c['bytes'] / 1e9:.1f} GB in {c['seconds']:.3f} s, "
                  f"{100 * c['overlapped_with_kernels']:.0f}% overlapped with kernels")
    if "memory" in report:
        m = report["memory"]
        print(f"memory: peak {m['peak_allocated_bytes'] / (1 << 30):.2f} GiB allocated in '{m['peak_phase']}', "
              f"{m['peak_reserved_bytes'] / (1 << 30):.2f} GiB reserved, {m['allocations']} allocator events")
        print("| phase | peak allocated (bytes) |\n| --- | --- |")
        for k, v in m["peak_by_phase_kind"].items():
            print(f"| {k} | {v} |")
        for k, v in list(m["peak_by_phase"].items())[:8]:  # profile.json has every phase
            print(f"| {k} | {v} |")
        print("\nalive at the peak, by the op that allocated it (profile.json has 40 rows):")
        print("| bytes | allocations | phase | op |\n| --- | --- | --- | --- |")
        for r in m["live_at_peak"][:16]:
            print(f"| {r['bytes']} | {r['allocations']} | {r['phase']} | {r['op']} |")


if __name__ == "__main__":
    main()
