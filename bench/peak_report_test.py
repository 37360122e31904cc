#!/usr/bin/env python3
"""bench/peak_report.py on made-up odyssey-bench results: the ratio planner / peak, the phase
sums by prefix, the peak's scope, --last, and a clear refusal of a missing or empty file."""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peak_report as pk  # noqa: E402

ROW = {"model": "hybrid-3b", "seq_len": 65536, "kda_chunk_size": 32, "seconds_per_step": 11.79,
       "gpu_peak_allocated_bytes": 20_000_000_000, "planned_gpu_peak_bytes": 21_000_000_000,
       "phase_peak": {"bytes": 20_000_000_000, "scopes": "layer 26 backward > kda backward: intra by hand"},
       "phase_seconds_per_step": {"kda forward: intra": {"count": 3, "seconds": 0.5},
                                  "kda backward: scans": {"count": 1, "seconds": 0.25},
                                  "dsa sparse attention backward": {"count": 2, "seconds": 1.5}}}


class PeakReportTest(unittest.TestCase):
    def test_line(self):
        line = pk.report(ROW, ["model", "kda_chunk_size"], ["kda ", "dsa sparse attention backward"])
        self.assertEqual(line, "model hybrid-3b, kda_chunk_size 32: 11.79 s/step, peak 20.00 GB, planner 21.00 GB "
                               "(1.050), 'kda ' phases 0.75 s, 'dsa sparse attention backward' phases 1.50 s, "
                               "peak in layer 26 backward > kda backward: intra by hand")

    def test_without_a_peak_or_plan(self):
        r = {"model": "tiny", "seq_len": 48, "seconds_per_step": 0.5, "gpu_peak_allocated_bytes": 0}
        self.assertEqual(pk.report(r, ["model"], []), "model tiny: 0.50 s/step, no GPU peak or no plan to compare")

    def test_command_line(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "r.jsonl")
            second = dict(ROW, seq_len=131072, gpu_peak_allocated_bytes=25_000_000_000)
            with open(path, "w", encoding="utf-8") as f:
                f.write(json.dumps(ROW) + "\n" + json.dumps(second) + "\n")
            script = os.path.join(HERE, "peak_report.py")
            out = subprocess.run([sys.executable, script, path], capture_output=True, text=True, check=True).stdout
            self.assertEqual(len(out.splitlines()), 2)
            last = subprocess.run([sys.executable, script, path, "--last"], capture_output=True, text=True,
                                  check=True).stdout.splitlines()
            self.assertEqual(len(last), 1)
            self.assertIn("seq_len 131072", last[0])
            self.assertIn("(0.840)", last[0])  # under the peak: the ratio shows it
            open(os.path.join(d, "empty.jsonl"), "w").close()
            for bad in ("missing.jsonl", "empty.jsonl"):
                p = subprocess.run([sys.executable, script, os.path.join(d, bad)], capture_output=True, text=True)
                self.assertEqual(p.returncode, 1)
                self.assertIn(bad, p.stderr)


if __name__ == "__main__":
    unittest.main()
