#!/usr/bin/env python3
"""One line per odyssey-bench JSON result: the step's time, its GPU peak against the planner's
prediction for the strategy it ran (`planned_gpu_peak_bytes` / `gpu_peak_allocated_bytes`: the
planner is to be at or above the peak and within 5% of it), the scope the peak was reached in
(with --phase-times) and, for each --sum PREFIX, the summed seconds of the phases whose name
starts with PREFIX.

    python3 bench/peak_report.py RESULTS.jsonl [--last] [--label KEY ...] [--sum PREFIX ...]

--last reports only the file's last line (the run just made); --label names the JSON fields that
lead each line (default: model, seq_len). A line without a GPU peak or a plan says so instead of
a ratio."""
import argparse
import json
import sys


def report(r, labels, sums):
    lead = ", ".join(f"{k} {r.get(k, '?')}" for k in labels)
    parts = [f"{r['seconds_per_step']:.2f} s/step" if "seconds_per_step" in r else "no step time"]
    peak, plan = r.get("gpu_peak_allocated_bytes", 0), r.get("planned_gpu_peak_bytes", 0)
    if peak > 0 and plan > 0:
        parts.append(f"peak {peak / 1e9:.2f} GB, planner {plan / 1e9:.2f} GB ({plan / peak:.3f})")
    else:
        parts.append("no GPU peak or no plan to compare")
    phases = r.get("phase_seconds_per_step", {})
    for prefix in sums:
        total = sum(v["seconds"] for k, v in phases.items() if k.startswith(prefix))
        parts.append(f"'{prefix}' phases {total:.2f} s")
    scope = r.get("phase_peak", {}).get("scopes")
    if scope:
        parts.append(f"peak in {scope}")
    return f"{lead}: " + ", ".join(parts)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--last", action="store_true")
    ap.add_argument("--label", nargs="*", default=["model", "seq_len"])
    ap.add_argument("--sum", nargs="*", default=[])
    a = ap.parse_args(argv)
    try:
        with open(a.results, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        print(f"peak_report: {a.results}: {e}", file=sys.stderr)
        return 1
    if not rows:
        print(f"peak_report: {a.results} holds no result", file=sys.stderr)
        return 1
    for r in rows[-1:] if a.last else rows:
        print(report(r, a.label, a.sum))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
