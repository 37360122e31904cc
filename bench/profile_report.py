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

The trace is read in one pass, one event at a time, keeping sums and compact columns rather
than the events: a long step's trace is several GB (6.3 GB at 512K tokens of a 28-layer model).
Files over 1 GB print their progress to stderr.

  python3 bench/profile_report.py out/profile/trace.json
"""
import argparse
import bisect
import codecs
import heapq
import json
import operator
import os
import re
import sys
import time
from array import array
from collections import defaultdict
from itertools import islice

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

CHUNK = 1 << 24  # bytes read at a time
_WS = re.compile(r"[ \t\n\r]*")
_COMMA = re.compile(r"[ \t\n\r]*,[ \t\n\r]*")


class _Reader:
    """A JSON text read `chunk` bytes at a time: buf[pos:] is what is not yet consumed."""

    def __init__(self, f, chunk, on_read):
        self.f, self.chunk, self.on_read = f, chunk, on_read
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.decode = json.JSONDecoder().raw_decode
        self.buf, self.pos, self.eof, self.read = "", 0, False, 0

    def fill(self):
        """Appends the next chunk to what is not consumed; False at the end of the file."""
        raw = self.f.read(self.chunk)
        self.read += len(raw)
        if self.on_read:
            self.on_read(self.read)
        self.buf = self.buf[self.pos:] + self.utf8.decode(raw, final=not raw)
        self.pos = 0
        if not raw:
            self.eof = True
        return bool(raw)

    def peek(self):
        """Skips whitespace; the next character, "" at the end of the file."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.fill():
                return ""

    def expect(self, chars):
        c = self.peek()
        if not c or c not in chars:
            at = self.read - len(self.buf) + self.pos
            raise ValueError(f"{self.f.name}: expected one of {chars!r} at byte ~{at}")
        self.pos += 1
        return c

    def value(self):
        """Decodes the value at pos. It is taken only when text follows it (a number cut by the
        chunk's end would parse short); a failure reads more, up to a bound a malformed file hits."""
        self.peek()
        while True:
            try:
                v, end = self.decode(self.buf, self.pos)
                if end < len(self.buf) or self.eof:
                    self.pos = end
                    return v
            except ValueError as err:
                if self.eof or len(self.buf) - self.pos > max(8 * self.chunk, 1 << 27):
                    pos = getattr(err, "pos", self.pos)
                    raise ValueError(f"{self.f.name}: malformed at byte ~{self.read - len(self.buf) + pos}: {err}")
            self.fill()


def trace_events(path, chunk=CHUNK, on_read=None):
    """Yields the events of the trace at `path` (its top-level "traceEvents" array) one at a time,
    reading `chunk` bytes at a time; on_read(bytes read so far) after each read. What follows the
    array is not read."""
    with open(path, "rb") as f:
        r = _Reader(f, chunk, on_read)
        r.expect("{")
        if r.peek() == "}":
            raise ValueError(f"{path}: no traceEvents")
        while True:
            key = r.value()
            r.expect(":")
            if key == "traceEvents":
                break
            r.value()
            if r.expect(",}") == "}":
                raise ValueError(f"{path}: no traceEvents")
        r.expect("[")
        if r.peek() == "]":
            return
        decode, comma = r.decode, _COMMA.match
        while True:
            # Most events lie whole inside the buffer, a comma after them: decoded here, past
            # the reader's checks and refills.
            try:
                e, end = decode(r.buf, r.pos)
                whole = end < len(r.buf)
            except ValueError:
                whole = False
            if whole:
                r.pos = end
            else:
                e = r.value()
            yield e
            m = comma(r.buf, r.pos)
            if m and m.end() < len(r.buf):
                r.pos = m.end()
            elif r.expect(",]") == "]":
                return


class _Spans:
    """The cpu ops of one thread in columns: start, end, name (an id in Trace.names); Trace.ops_of
    adds skip (whether each is a bare allocation)."""

    def __init__(self):
        self.starts, self.ends, self.names = array("d"), array("d"), array("l")


def _sort_columns(key, cols):
    """cols (key among them) reordered by a stable sort on key, as list.sort orders events."""
    if all(map(operator.le, key, islice(key, 1, None))):
        return cols
    order = sorted(range(len(key)), key=key.__getitem__)
    return [array(c.typecode, map(c.__getitem__, order)) for c in cols]


def innermost(starts, ends, skip, t):
    """The index of the innermost span around t among spans sorted by start, those with skip[i]
    passed over (skip None: none); -1 if none."""
    i = bisect.bisect_right(starts, t) - 1
    # Scanning back from the last span begun by t, the first one still running at t is the
    # innermost (scopes nest); a window bounds the scan.
    for j in range(i, max(-1, i - 4000), -1):
        if starts[j] <= t <= ends[j] and not (skip and skip[j]):
            return j
    return -1


class Memory:
    """The allocator events of one device in columns, in time order after finish()."""

    def __init__(self):
        self.ts, self.tid = array("d"), array("l")
        self.addr, self.bytes, self.allocated, self.reserved = array("q"), array("q"), array("q"), array("q")

    def add(self, e, tid):
        a = e["args"]
        self.ts.append(e["ts"])
        self.tid.append(tid)
        self.addr.append(a["Addr"])
        self.bytes.append(a["Bytes"])
        self.allocated.append(a["Total Allocated"])
        self.reserved.append(a["Total Reserved"])

    def finish(self):
        (self.ts, self.tid, self.addr, self.bytes, self.allocated, self.reserved) = _sort_columns(
            self.ts, [self.ts, self.tid, self.addr, self.bytes, self.allocated, self.reserved])

    def __len__(self):
        return len(self.ts)


class Trace:
    """What the report needs of a trace's events, gathered one event at a time (add): kernel time
    by name and kind, the kernels' and copies' intervals, the phases, the cpu ops in columns per
    thread and the allocator events of the devices the report may pick (device_id, or CUDA 0 and
    the CPU until the trace shows whether it ran on a GPU)."""

    def __init__(self, device_id=None):
        self.kernels = array("d"), array("d")  # (starts, ends)
        self.kernel_by_kind = defaultdict(float)
        self.kernel_by_name = {}
        self._kinds = {}
        self.phases = {"user_annotation": [], "gpu_user_annotation": []}  # {name, ts, dur}, in trace order
        self.copies = {d: (array("d"), array("d"), [0]) for d in ("HtoD", "DtoH", "DtoD")}  # starts, ends, bytes
        # The first start and last end of the kernels, of the cpu ops with a duration, and of each
        # phase category.
        self.span = {k: [None, None] for k in ("kernel", "cpu_op", "user_annotation", "gpu_user_annotation")}
        self.ops = {}  # tid id -> _Spans of its cpu ops, in trace order until ops_of sorts them
        self._ops_sorted = set()
        self.tids, self.names = {}, {}
        self.memory = {d: Memory() for d in ((0, -1) if device_id is None else (device_id,))}

    def _extend(self, key, ts, end):
        s = self.span[key]
        if s[0] is None or ts < s[0]:
            s[0] = ts
        if s[1] is None or end > s[1]:
            s[1] = end

    def add(self, e):
        cat = e.get("cat")
        if cat == "kernel":
            if "dur" in e:
                name, ts, dur = e["name"], e["ts"], e["dur"]
                self.kernels[0].append(ts)
                self.kernels[1].append(ts + dur)
                self._extend("kernel", ts, ts + dur)
                kind = self._kinds.get(name)
                if kind is None:
                    kind = self._kinds[name] = kind_of(name)
                self.kernel_by_kind[kind] += dur / 1e6
                n = self.kernel_by_name.get(name)
                if n is None:
                    n = self.kernel_by_name[name] = [0.0, 0]
                n[0] += dur / 1e6
                n[1] += 1
        elif cat == "cpu_op":
            if "dur" in e:
                self._extend("cpu_op", e["ts"], e["ts"] + e["dur"])
            if e.get("ph") == "X":
                tid = self.tids.setdefault(e.get("tid"), len(self.tids))
                s = self.ops.get(tid)
                if s is None:
                    s = self.ops[tid] = _Spans()
                s.starts.append(e["ts"])
                s.ends.append(e["ts"] + e.get("dur", 0))
                s.names.append(self.names.setdefault(e["name"], len(self.names)))
        elif cat in self.phases:
            if "dur" in e:
                self.phases[cat].append({"name": e["name"], "ts": e["ts"], "dur": e["dur"]})
                self._extend(cat, e["ts"], e["ts"] + e["dur"])
        elif cat == "gpu_memcpy":
            if "dur" in e:
                for d, (starts, ends, nbytes) in self.copies.items():
                    if d in e["name"]:
                        starts.append(e["ts"])
                        ends.append(e["ts"] + e["dur"])
                        nbytes[0] += e.get("args", {}).get("bytes", 0)
        if e.get("name") == "[memory]":
            m = self.memory.get(e.get("args", {}).get("Device Id"))
            if m is not None:
                m.add(e, self.tids.setdefault(e.get("tid"), len(self.tids)))

    def ops_of(self, tid):
        """The cpu ops of thread id `tid` sorted by start (None if it ran none), skip[i] marking the
        bare allocations."""
        s = self.ops.get(tid)
        if s is not None and tid not in self._ops_sorted:
            s.starts, s.ends, s.names = _sort_columns(s.starts, [s.starts, s.ends, s.names])
            alloc = [bool(ALLOC_OPS.match(n)) for n in self.names]
            s.skip = [alloc[i] for i in s.names]
            self._ops_sorted.add(tid)
        return s


def live_at_peak(trace, mem, peak, phases):
    """The allocations of `mem` (a finished Memory of `trace`) alive at its event `peak` (an index),
    grouped by (phase, op): the innermost CPU op on the allocating thread around each allocation,
    bare allocations (aten::empty and kin) skipped so the op that asked for the memory names it.
    Returns [(bytes, count, phase, op)], largest first."""
    live = {}
    for i in range(peak + 1):
        if mem.bytes[i] > 0:
            live[mem.addr[i]] = i
        else:
            live.pop(mem.addr[i], None)
    op_names = list(trace.names)
    phase_list = sorted(phases, key=lambda p: p["ts"])
    phase_starts = [p["ts"] for p in phase_list]
    phase_ends = [p["ts"] + p.get("dur", 0) for p in phase_list]

    groups = defaultdict(lambda: [0, 0])
    for i in live.values():
        t = mem.ts[i]
        ops = trace.ops_of(mem.tid[i])
        op = innermost(ops.starts, ops.ends, ops.skip, t) if ops else -1
        ph = innermost(phase_starts, phase_ends, None, t)
        key = (phase_list[ph]["name"] if ph >= 0 else "outside every phase",
               op_names[ops.names[op]] if op >= 0 else "?")
        groups[key][0] += mem.bytes[i]
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


def summarize(trace, device_id=None, out_dir=None):
    """The report (profile.json's content) of a gathered Trace; with out_dir, memory.png there
    where matplotlib is installed."""
    gpu = bool(trace.kernels[0])
    ann_cat = "gpu_user_annotation" if gpu else "user_annotation"
    phases = trace.phases[ann_cat]
    cpu_phases = trace.phases["user_annotation"]
    spans = [s for s in (trace.span["kernel" if gpu else "cpu_op"], trace.span[ann_cat]) if s[0] is not None]
    if not spans:
        raise ValueError("the trace has no kernels, cpu ops or phases")
    t0 = min(s[0] for s in spans)
    t1 = max(s[1] for s in spans)
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
        busy = union(zip(*trace.kernels))
        report["kernel_seconds_by_kind"] = dict(sorted(trace.kernel_by_kind.items(), key=lambda kv: -kv[1]))
        report["gpu_busy_seconds"] = sum(e - s for s, e in busy) / 1e6
        report["top_kernels"] = [
            {"name": n[:160], "seconds": t, "calls": c}
            for n, (t, c) in sorted(trace.kernel_by_name.items(), key=lambda kv: -kv[1][0])[:12]
        ]
        copy_report = {}
        for direction, (starts, ends, nbytes) in trace.copies.items():
            if not starts:
                continue
            spans = union(zip(starts, ends))
            total = sum(e - s for s, e in spans)
            copy_report[direction] = {
                "bytes": nbytes[0],
                "seconds": total / 1e6,
                "overlapped_with_kernels": overlap(spans, busy) / total if total else 0.0,
            }
        report["copies"] = copy_report

    device = device_id if device_id is not None else (0 if gpu else -1)
    mem = trace.memory[device]
    mem.finish()
    if len(mem):
        peak = max(range(len(mem)), key=mem.allocated.__getitem__)
        peak_ts = mem.ts[peak]
        inside = [p for p in cpu_phases if p["ts"] <= peak_ts <= p["ts"] + p["dur"]]
        innermost_phase = min(inside, key=lambda p: p["dur"])["name"] if inside else "outside every phase"
        report["memory"] = {
            "device_id": device,
            "peak_allocated_bytes": mem.allocated[peak],
            "peak_reserved_bytes": max(mem.reserved),
            "peak_phase": innermost_phase,
            "allocations": len(mem),
        }
        # The highest allocation in each phase (innermost scope; layers grouped by kind as well):
        # what the planner's phase model predicts term by term.
        # One sweep in time order (a step at length has ~10^6 allocations and ~10^4 phases):
        # the phases begun so far in a heap by duration, the shortest one not yet ended on top.
        by_name, by_kind = {}, {}
        starts = sorted(cpu_phases, key=lambda p: p["ts"])
        begun, nxt = [], 0
        for ts, a in zip(mem.ts, mem.allocated):
            while nxt < len(starts) and starts[nxt]["ts"] <= ts:
                p = starts[nxt]
                heapq.heappush(begun, (p["dur"], nxt, p))
                nxt += 1
            while begun and begun[0][2]["ts"] + begun[0][2]["dur"] < ts:
                heapq.heappop(begun)
            name = begun[0][2]["name"] if begun else "outside every phase"
            by_name[name] = max(by_name.get(name, 0), a)
            by_kind[phase_kind(name)] = max(by_kind.get(phase_kind(name), 0), a)
        report["memory"]["live_at_peak"] = [
            {"bytes": b, "allocations": c, "phase": ph, "op": op}
            for b, c, ph, op in live_at_peak(trace, mem, peak, cpu_phases)[:40]
        ]
        report["memory"]["peak_by_phase_kind"] = dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))
        report["memory"]["peak_by_phase"] = dict(sorted(by_name.items(), key=lambda kv: -kv[1]))
        if out_dir is not None:
            try:
                plot_memory(mem, peak, cpu_phases, innermost_phase, os.path.join(out_dir, "memory.png"))
                report["memory"]["plot"] = os.path.join(out_dir, "memory.png")
            except ImportError:
                pass
    return report


def plot_memory(mem, peak, cpu_phases, peak_phase, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    c0 = mem.ts[0]
    ts = [(t - c0) / 1e6 for t in mem.ts]
    gib = float(1 << 30)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    colors = {"forward": "#cfe3f7", "recompute": "#f7e3cf", "backward": "#f7cfcf"}
    for p in cpu_phases:
        m = re.match(r"layers? [\d-]+ (forward|recompute|backward)$", p["name"])
        if m:
            ax.axvspan((p["ts"] - c0) / 1e6, (p["ts"] + p["dur"] - c0) / 1e6, color=colors[m.group(1)], lw=0)
    ax.plot(ts, [a / gib for a in mem.allocated], lw=0.8, label="allocated")
    ax.plot(ts, [r / gib for r in mem.reserved], lw=0.8, label="reserved")
    ax.axhline(mem.allocated[peak] / gib, color="k", lw=0.5, ls=":")
    ax.set_xlabel("host time in the step (s); shading: layer forward (blue), recompute (orange), backward (red)")
    ax.set_ylabel("GiB")
    ax.set_title(f"memory over one step; peak {mem.allocated[peak] / gib:.1f} GiB in '{peak_phase}'")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_report(report):
    gpu = report["timeline"] == "gpu"
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--device-id", type=int, default=None, help="memory of this device (default: CUDA 0, or the CPU)")
    args = ap.parse_args()
    out_dir = os.path.dirname(os.path.abspath(args.trace))
    size, started, shown = os.path.getsize(args.trace), time.monotonic(), [0]

    def progress(n, end=""):
        # One line rewritten in place (a log that takes stderr too keeps the report's head in view).
        print(f"\rprofile_report: {n / 1e9:.1f} of {size / 1e9:.1f} GB read in {time.monotonic() - started:.0f} s",
              end=end, file=sys.stderr, flush=True)

    def on_read(n):
        if size >= 1 << 30 and n >> 30 > shown[0]:
            shown[0] = n >> 30
            progress(n)

    trace = Trace(args.device_id)
    for e in trace_events(args.trace, on_read=on_read):
        trace.add(e)
    if size >= 1 << 30:
        progress(size, end="\n")
    report = summarize(trace, args.device_id, out_dir)
    with open(os.path.join(out_dir, "profile.json"), "w") as f:
        json.dump(report, f, indent=1)
    print_report(report)


if __name__ == "__main__":
    main()
