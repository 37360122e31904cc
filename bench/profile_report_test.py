#!/usr/bin/env python3
"""bench/profile_report.py's "alive at the peak" on a made-up trace: allocations freed before the
peak are gone, the rest are grouped by the innermost op around them (bare allocations such as
aten::empty give way to the op that called them) and by the phase they were made in."""
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import profile_report as pr  # noqa: E402


def op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def alloc(ts, addr, nbytes, total, tid=1):
    return {"ph": "i", "name": "[memory]", "ts": ts, "tid": tid,
            "args": {"Addr": addr, "Bytes": nbytes, "Total Allocated": total, "Total Reserved": 0, "Device Id": -1}}


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
        peak = mem[5]
        rows = pr.live_at_peak(events + mem, mem, peak, phases)
        self.assertEqual(rows, [(100, 1, "layer 1 recompute", "aten::mm"),
                                (30, 2, "layer 1 backward", "aten::mul"),
                                (7, 1, "layer 1 backward", "?")])


if __name__ == "__main__":
    unittest.main()
