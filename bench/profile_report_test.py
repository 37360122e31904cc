#!/usr/bin/env python3
"""bench/profile_report.py on made-up traces:
- "alive at the peak": allocations freed before the peak are gone, the rest are grouped by the
  innermost op around them (bare allocations such as aten::empty give way to the op that called
  them) and by the phase they were made in;
- the streaming reader: the events of a trace read a few bytes at a time (JSON values, UTF-8
  characters and events cut by chunk boundaries) are those of json.load, and the report of a
  generated step of ~20K events, read in chunks and through the command line, is that of its
  events loaded whole and has the totals the generator put in."""
import json
import os
import random
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_report as pr  # noqa: E402


def op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def alloc(ts, addr, nbytes, total, tid=1, device=-1, reserved=0):
    return {"ph": "i", "name": "[memory]", "ts": ts, "tid": tid,
            "args": {"Addr": addr, "Bytes": nbytes, "Total Allocated": total, "Total Reserved": reserved,
                     "Device Id": device}}


def gather(events, device_id=None):
    trace = pr.Trace(device_id)
    for e in events:
        trace.add(e)
    return trace


class LiveAtPeakTest(unittest.TestCase):
    def test_groups_what_is_alive_by_op_and_phase(self):
        phases = [op("layer 1 recompute", 0, 100, cat="user_annotation"),
                  op("layer 1 backward", 100, 100, cat="user_annotation")]
        events = phases + [
            op("aten::mm", 10, 10), op("aten::empty", 12, 1),     # mm asked for it through empty
            op("aten::add", 30, 5),
            op("aten::zeros_like", 110, 5),                          # a bare allocation, no caller
            op("aten::mul", 120, 10), op("aten::mul", 140, 10),
        ]
        mem = [alloc(12.5, 1, 100, 100), alloc(32, 2, 50, 150), alloc(105, 2, -50, 100),  # the add's freed
               alloc(111, 3, 7, 107), alloc(121, 4, 10, 117), alloc(141, 5, 20, 137),
               alloc(160, 6, 1000, 1137)]  # after the peak asked about: not alive at it
        trace = gather(events + mem, device_id=-1)
        m = trace.memory[-1]
        m.finish()
        rows = pr.live_at_peak(trace, m, 5, phases)
        self.assertEqual(rows, [(100, 1, "layer 1 recompute", "aten::mm"),
                                (30, 2, "layer 1 backward", "aten::mul"),
                                (7, 1, "layer 1 backward", "?")])


# Names that a reader splitting the text naively would cut wrong: braces, brackets, commas,
# quotes and escapes inside strings, and characters of 2 and 3 UTF-8 bytes.
KERNELS = ["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n", "flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64>>",
           "void odyssey::rmsnorm_fwd<bf16>() }, { \"ph\": \"X\" ], [", "vectorized_elementwise_kernel µ→ \\ \"",
           "reduce_kernel<512, 1>"]
OPS = ["aten::linear", "aten::mm", "aten::add", "aten::copy_ }, {", "aten::sum ] ,"]


def make_trace(n_ops, seed=1, layers=3):
    """A Kineto-shaped step of `layers` layers (forward and backward) with n_ops cpu ops in all,
    each launching a kernel and allocating; events shuffled. Returns (document, totals)."""
    rnd = random.Random(seed)
    events, totals = [], {"kernel_calls": 0, "kernel_seconds": 0.0, "copy_bytes": {}, "mem0": [], "mem_cpu": 0}
    t, gt, addr, allocated = 1000.0, 1050.0, 1 << 40, 0
    live = []
    per = max(1, n_ops // (2 * layers))
    for layer in range(layers):
        for kind in ("forward", "backward"):
            p0, g0 = t, gt
            for i in range(per):
                d = round(rnd.uniform(5, 50), 3)
                tid = 1 if i % 3 else 2
                events.append({"ph": "X", "cat": "cpu_op", "name": OPS[i % len(OPS)], "pid": 9, "tid": tid,
                               "ts": t, "dur": d, "args": {"External id": i, "Ev Idx": i}})
                events.append({"ph": "X", "cat": "cpu_op", "name": "aten::empty", "pid": 9, "tid": tid,
                               "ts": t + 1.0, "dur": 0.5, "args": {"Ev Idx": i}})
                nbytes = rnd.choice([512, 4096, 1 << 20, 1 << 26])
                addr += nbytes
                allocated += nbytes
                live.append((addr, nbytes))
                events.append(alloc(t + 1.2, addr, nbytes, allocated, tid=tid, device=0,
                                    reserved=allocated + (1 << 30)))
                totals["mem0"].append(allocated)
                if i % 4 == 0:
                    events.append(alloc(t + 1.3, 7 + i, 64, 64 * i, tid=tid, device=-1))
                    totals["mem_cpu"] += 1
                while len(live) > 30 or (live and rnd.random() < 0.3):
                    a, b = live.pop(rnd.randrange(len(live)))
                    allocated -= b
                    events.append(alloc(t + d - 0.5, a, -b, allocated, tid=tid, device=0,
                                        reserved=allocated + (1 << 30)))
                    totals["mem0"].append(allocated)
                events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 9, "tid": tid,
                               "ts": t + 2.0, "dur": 1.5, "args": {"correlation": i}})
                events.append({"ph": "s", "id": i, "pid": 9, "tid": tid, "ts": t + 2.0, "cat": "ac2g",
                               "name": "ac2g"})
                gd = round(rnd.uniform(1, 80), 3)
                gs = max(gt + 0.5, t + 3.0)
                events.append({"ph": "X", "cat": "kernel", "name": KERNELS[i % len(KERNELS)], "pid": 0, "tid": 7,
                               "ts": gs, "dur": gd, "args": {"stream": 7, "grid": [132, 1, 1], "block": [128, 1, 1],
                                                             "blocks per SM": 1.5}})
                totals["kernel_calls"] += 1
                totals["kernel_seconds"] += gd / 1e6
                if i % 7 == 0:  # on a second stream, inside the first stream's kernel: no busy time of its own
                    events.append({"ph": "X", "cat": "kernel", "name": "fill_kernel", "pid": 0, "tid": 8,
                                   "ts": gs + gd / 4, "dur": gd / 2, "args": {"stream": 8}})
                    totals["kernel_calls"] += 1
                    totals["kernel_seconds"] += gd / 2 / 1e6
                if i % 11 == 0:
                    direction = ("HtoD", "DtoH", "DtoD")[i % 3]
                    events.append({"ph": "X", "cat": "gpu_memcpy", "name": f"Memcpy {direction} (Pinned -> Device)",
                                   "pid": 0, "tid": 9, "ts": gs, "dur": 3.0, "args": {"bytes": 1000 + i}})
                    totals["copy_bytes"][direction] = totals["copy_bytes"].get(direction, 0) + 1000 + i
                gt = gs + gd
                t += d + 1.0
            name = f"layer {layer} {kind}"
            events.append({"ph": "X", "cat": "user_annotation", "name": name, "pid": 9, "tid": 1, "ts": p0,
                           "dur": t - p0})
            events.append({"ph": "X", "cat": "gpu_user_annotation", "name": name, "pid": 0, "tid": 7, "ts": g0,
                           "dur": gt - g0})
    events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": 9, "tid": 1, "args": {"name": "thread 1 (µ)"}})
    rnd.shuffle(events)
    # Values before traceEvents that the reader skips: nested, a bracket in a string, a long number.
    doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "x": [[1, 2], {"a": "]"}]}],
           "baseTimeNanoseconds": 1790857026000000000, "traceEvents": events, "traceName": "trace.json"}
    return doc, totals


def write(doc, path):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False)


class StreamingTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)

    def test_events_cut_by_chunk_boundaries_are_read_once(self):
        doc, _ = make_trace(40)
        path = os.path.join(self.dir.name, "trace.json")
        write(doc, path)
        for chunk in (1, 2, 3, 7, 64, 1000):
            with self.subTest(chunk=chunk):
                self.assertEqual(list(pr.trace_events(path, chunk=chunk)), doc["traceEvents"])
        # Compact text: values and separators with no whitespace between them.
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, separators=(",", ":"), ensure_ascii=False)
        for chunk in (1, 5):
            with self.subTest(chunk=chunk, compact=True):
                self.assertEqual(list(pr.trace_events(path, chunk=chunk)), doc["traceEvents"])

    def test_malformed_trace_is_refused(self):
        path = os.path.join(self.dir.name, "trace.json")
        with open(path, "w") as f:
            f.write('{"traceEvents": [{"ph": "X"}, {"ph": ')  # cut short
        with self.assertRaises(ValueError):
            list(pr.trace_events(path, chunk=4))

    def test_report_of_a_streamed_step_is_that_of_its_events_loaded_whole(self):
        doc, totals = make_trace(3000)
        path = os.path.join(self.dir.name, "trace.json")
        write(doc, path)
        whole = pr.summarize(gather(doc["traceEvents"]))
        for chunk in (4093, 1 << 16, pr.CHUNK):
            with self.subTest(chunk=chunk):
                self.assertEqual(pr.summarize(gather(pr.trace_events(path, chunk=chunk))), whole)

        self.assertEqual(whole["timeline"], "gpu")
        self.assertEqual(sum(k["calls"] for k in whole["top_kernels"]), totals["kernel_calls"])
        self.assertAlmostEqual(sum(whole["kernel_seconds_by_kind"].values()), totals["kernel_seconds"], places=9)
        busy = sum(e["dur"] for e in doc["traceEvents"] if e.get("cat") == "kernel" and e["tid"] == 7) / 1e6
        self.assertAlmostEqual(whole["gpu_busy_seconds"], busy, places=9)
        self.assertEqual({d: c["bytes"] for d, c in whole["copies"].items()}, totals["copy_bytes"])
        m = whole["memory"]
        self.assertEqual((m["device_id"], m["allocations"]), (0, len(totals["mem0"])))
        self.assertEqual(m["peak_allocated_bytes"], max(totals["mem0"]))
        self.assertEqual(m["peak_reserved_bytes"], max(totals["mem0"]) + (1 << 30))
        self.assertEqual(set(m["peak_by_phase_kind"]), {"layers forward", "layers backward"})
        self.assertNotIn("?", {r["op"] for r in m["live_at_peak"]})
        self.assertNotIn("aten::empty", {r["op"] for r in m["live_at_peak"]})

        # The command line writes the same report.
        subprocess.run([sys.executable, pr.__file__, path], check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(self.dir.name, "profile.json")) as f:
            written = json.load(f)
        written["memory"].pop("plot", None)  # where matplotlib is installed
        self.assertEqual(written, json.loads(json.dumps(whole)))

        # Without kernels the CPU's timeline and allocations are the report's.
        cpu = pr.summarize(gather(e for e in doc["traceEvents"] if e.get("cat") != "kernel"))
        self.assertEqual(cpu["timeline"], "cpu")
        self.assertEqual((cpu["memory"]["device_id"], cpu["memory"]["allocations"]), (-1, totals["mem_cpu"]))


if __name__ == "__main__":
    unittest.main()
