#!/usr/bin/env python3
"""Tests of odyssey-plot (odyssey_client/plot.py): a job's step events become a PNG with three
panels (loss, tokens/s, GPU memory), checked by decoding the PNG: its size, and in each panel the
line's pixels, which must run the way the series does (the loss falls, the others rise). Also:
a restarted step drawn with its latest report, and the errors (no steps, bad JSON).

`check_png(test, path, trends)` is used by tests/service/guide_test.py on the PNG that
`odyssey plot` writes for a real job.

Run: python client/python/tests/test_plot.py  (needs matplotlib, which scripts/setup.sh installs)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_unit import oc  # noqa: E402,F401  (the scratch copy of the package, with stubs)

from odyssey_client import plot  # noqa: E402

LINE_RGB = (31, 119, 180)  # matplotlib's tab:blue, the color of every panel's line


def line_pixels(image, box):
    """(x, y) of the pixels within `box` close to the line color."""
    import numpy as np

    left, top, right, bottom = box
    rgb = (image[top:bottom, left:right, :3] * 255).astype(int)
    close = (abs(rgb - np.array(LINE_RGB)).sum(axis=2) < 60)
    ys, xs = np.nonzero(close)
    return xs, ys


def check_png(test, path, trends, min_pixels=100):
    """Decodes the PNG at `path` and checks its size and, per panel (in plot.PANELS order), that
    the line is drawn (at least `min_pixels` pixels) and runs as `trends` says: -1 falling (the
    left end higher on the image), +1 rising, 0 anything."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image

    with open(path, "rb") as f:
        test.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
    image = matplotlib.image.imread(path)
    test.assertEqual(image.shape[:2], (plot.HEIGHT_PX, plot.WIDTH_PX))
    # The panels' plot areas, as render() lays them out (same figure size and layout), are found
    # again from the image: each is a band of rows holding line pixels, separated by rows without.
    xs, ys = line_pixels(image, (0, 0, plot.WIDTH_PX, plot.HEIGHT_PX))
    test.assertGreater(len(xs), len(trends) * min_pixels, "no line drawn")
    rows = sorted(set(ys.tolist()))
    bands, start = [], rows[0]
    for a, b in zip(rows, rows[1:] + [None]):
        if b is None or b - a > 30:
            bands.append((start, a))
            start = b
    test.assertEqual(len(bands), len(trends), f"line bands {bands}: expected one per panel")
    for (top, bottom), trend, panel in zip(bands, trends, plot.PANELS):
        inside = (ys >= top) & (ys <= bottom)
        px, py = xs[inside], ys[inside]
        test.assertGreaterEqual(len(px), min_pixels, f"{panel[0]}: line not drawn")
        span = px.max() - px.min()
        test.assertGreater(span, plot.WIDTH_PX // 2, f"{panel[0]}: the line does not cross the panel")
        left_y = py[px < px.min() + span / 5].mean()
        right_y = py[px > px.max() - span / 5].mean()
        if trend < 0:
            test.assertLess(left_y, right_y - 20, f"{panel[0]}: the line should fall")
        elif trend > 0:
            test.assertGreater(left_y, right_y + 20, f"{panel[0]}: the line should rise")


def step_event(step, loss, tps, gpu):
    return {"job": "jobs/3", "step": {"step": str(step), "loss": loss, "tokens_per_second": tps,
                                      "gpu_memory_peak_bytes": str(gpu)}}


class PlotTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="odyssey_plot_test_")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def events(self):
        ev = [{"job": "jobs/3", "state": "RUNNING"}]
        for step in range(1, 41):
            ev.append(step_event(step, 5.0 - 0.1 * step, 100.0 * step, step * 2**28))
            if step == 20:
                ev.append({"job": "jobs/3", "checkpoint": "/ckpt/step-20"})
        # A restart from step 20's checkpoint reports steps 21..25 again: the latest report wins.
        ev.append({"job": "jobs/3", "message": "restarted from /ckpt/step-20"})
        for step in range(21, 26):
            ev.append(step_event(step, 5.0 - 0.1 * step - 0.01, 100.0 * step, step * 2**28))
        ev.append({"job": "jobs/3", "state": "SUCCEEDED"})
        return ev

    def write_events(self, events, raw=()):
        path = os.path.join(self.dir, "events.jsonl")
        with open(path, "w") as f:
            for e in events:
                f.write(json.dumps(e) + "\n")
            for line in raw:
                f.write(line + "\n")
        return path

    def test_series_takes_each_steps_latest_report(self):
        s = plot.series_of(self.events())
        self.assertEqual(s.steps, list(range(1, 41)))
        self.assertAlmostEqual(s.values["loss"][22], 5.0 - 2.3 - 0.01)
        self.assertAlmostEqual(s.values["gpu_memory_peak_bytes"][3], 1.0)  # 4 * 2^28 bytes = 1 GiB

    def test_png_shows_the_three_series(self):
        out = os.path.join(self.dir, "job.png")
        rc = plot.main(["jobs/3", "--events", self.write_events(self.events()), "-o", out])
        self.assertEqual(rc, 0)
        check_png(self, out, trends=(-1, +1, +1))

    def test_cli_from_stdin_and_errors(self):
        out = os.path.join(self.dir, "stdin.png")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        lines = "".join(json.dumps(e) + "\n" for e in self.events())
        run = subprocess.run([sys.executable, "-m", "odyssey_client.plot", "jobs/3", "--events", "-", "-o", out],
                             input=lines, capture_output=True, text=True, env=env, timeout=300)
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn("40 steps (1-40) of jobs/3", run.stdout)
        self.assertTrue(os.path.getsize(out) > 1000)
        none = self.write_events([{"job": "jobs/4", "state": "PENDING"}])
        self.assertEqual(plot.main(["jobs/4", "--events", none, "-o", os.path.join(self.dir, "none.png")]), 2)
        self.assertFalse(os.path.exists(os.path.join(self.dir, "none.png")))
        with self.assertRaisesRegex(plot.PlotError, r"line 2: invalid JSON"):
            with open(self.write_events(self.events()[:1], raw=["{oops"])) as f:
                plot.read_event_lines(f, "events.jsonl")
        with self.assertRaisesRegex(plot.PlotError, r"event 1: step.loss: 'x' is not a number"):
            plot.series_of([{"step": {"step": "1", "loss": "x"}}])


if __name__ == "__main__":
    unittest.main(argv=[sys.argv[0]] + [a for a in sys.argv[1:] if a != "--installed"])
