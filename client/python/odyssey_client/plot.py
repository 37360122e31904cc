"""odyssey-plot: a PNG of a job's loss, tokens/s and GPU memory over its steps, from the events
the controller recorded (JobService.ListJobEvents).

    odyssey plot JOB -o job.png                       (the CLI fetches the events and runs this)
    odyssey-plot JOB -o job.png --controller HOST:PORT [--token-file F] [--tls-ca PEM]
    odyssey plot JOB --json | odyssey-plot --events - -o job.png

--events reads JobEvents as JSON, one per line (the protobuf JSON mapping with the proto's field
names, as `odyssey plot JOB --json` prints them). A step reported more than once (a job restarted
from a checkpoint redoes the steps after it) is drawn with its latest report. Needs matplotlib
(pip install 'odyssey-client[plot]'). Exit 0 written; 2 bad input or no step events; 3 the job
does not exist; 1 another error.
"""
import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Iterable, List, Optional

# (panel title, y label, StepMetrics field, scale)
PANELS = (
    ("loss", "nats / token", "loss", 1.0),
    ("throughput", "tokens / s", "tokens_per_second", 1.0),
    ("GPU memory peak", "GiB", "gpu_memory_peak_bytes", 1.0 / 2**30),
)
WIDTH_PX, HEIGHT_PX, DPI = 900, 960, 100


class PlotError(Exception):
    """Bad input: the message names the line or the job."""


@dataclass
class Series:
    steps: List[int] = field(default_factory=list)
    values: dict = field(default_factory=lambda: {p[2]: [] for p in PANELS})


def _number(v, where: str) -> float:
    # int64 fields are JSON strings in the protobuf mapping, doubles are numbers.
    try:
        return float(v)
    except (TypeError, ValueError):
        raise PlotError(f"{where}: {v!r} is not a number") from None


def series_of(events: Iterable[dict], where: str = "event") -> Series:
    """The step metrics of `events` (dicts of the JobEvent JSON mapping), one point per step
    (the latest report of a step wins), ordered by step."""
    latest = {}
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            raise PlotError(f"{where} {i + 1}: expected a JSON object, got {type(e).__name__}")
        step = e.get("step")
        if step is None:
            continue
        if not isinstance(step, dict):
            raise PlotError(f"{where} {i + 1}: step must be an object (StepMetrics)")
        n = int(_number(step.get("step", 0), f"{where} {i + 1}: step.step"))
        if n <= 0:
            continue
        latest[n] = {p[2]: _number(step.get(p[2], 0), f"{where} {i + 1}: step.{p[2]}") * p[3] for p in PANELS}
    s = Series()
    for n in sorted(latest):
        s.steps.append(n)
        for k, v in latest[n].items():
            s.values[k].append(v)
    return s


def read_event_lines(stream, name: str) -> List[dict]:
    events = []
    for line_no, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise PlotError(f"{name} line {line_no}: invalid JSON ({e.msg})") from e
    return events


def render(s: Series, output: str, title: str) -> List[tuple]:
    """Writes the PNG (WIDTH_PX x HEIGHT_PX), atomically: three panels over the steps. Returns
    each panel's plot area in image pixels, (left, top, right, bottom) from the top-left corner."""
    if not s.steps:
        raise PlotError(f"{title}: no step events to plot (has the job run a step yet?)")
    try:
        import matplotlib
    except ImportError as e:
        raise PlotError("odyssey-plot needs matplotlib: pip install 'odyssey-client[plot]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(PANELS), 1, sharex=True, figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    try:
        for ax, (panel, unit, key, _) in zip(axes, PANELS):
            ys = s.values[key]
            marker = "o" if len(s.steps) < 50 else None
            ax.plot(s.steps, ys, color="tab:blue", linewidth=1.5, marker=marker, markersize=3)
            ax.set_title(panel, loc="left", fontsize=10)
            ax.set_ylabel(unit)
            ax.grid(True, alpha=0.3)
            if key == "gpu_memory_peak_bytes" and not any(ys):
                ax.text(0.5, 0.75, "no GPU memory reported (a CPU worker)", transform=ax.transAxes, ha="center",
                        va="center", color="0.4")
        axes[-1].set_xlabel("step")
        fig.suptitle(f"{title}: steps {s.steps[0]}-{s.steps[-1]}", fontsize=11)
        fig.tight_layout()
        out_dir = os.path.dirname(os.path.abspath(output))
        fd, tmp = tempfile.mkstemp(prefix=".odyssey-plot-", suffix=".png", dir=out_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                fig.savefig(f, format="png", dpi=DPI)
            os.replace(tmp, output)
        except BaseException:
            os.unlink(tmp)
            raise
        boxes = []
        for ax in axes:
            b = ax.get_window_extent()
            boxes.append((int(b.x0), int(HEIGHT_PX - b.y1), int(b.x1), int(HEIGHT_PX - b.y0)))
        return boxes
    finally:
        plt.close(fig)


def fetch_events(controller: str, job: str, token: Optional[str], tls_ca: Optional[str]) -> List[dict]:
    """Every recorded event of `job` from the controller, as JSON-mapping dicts."""
    from google.protobuf import json_format

    from odyssey_client.client import TrainingClient

    with TrainingClient(controller, token=token, tls_ca=tls_ca) as client:
        return [json_format.MessageToDict(e, preserving_proto_field_name=True) for e in client.job_events(job)]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="odyssey-plot", description=__doc__.split("\n\n")[0])
    p.add_argument("job", nargs="?", help="jobs/N or N (with --controller); the title with --events")
    p.add_argument("-o", "--output", help="PNG to write (default: job-N.png)")
    p.add_argument("--events", help="read JobEvent JSON lines from this file ('-' = stdin) instead of a controller")
    p.add_argument("--controller", default=os.environ.get("ODYSSEY_CONTROLLER", "localhost:50051"))
    p.add_argument("--token-file", help="bearer token file (else env ODYSSEY_TOKEN)")
    p.add_argument("--tls-ca", default=os.environ.get("ODYSSEY_TLS_CA"), help="CA bundle: TLS on")
    args = p.parse_args(argv)
    name = args.job or "events"
    if name.isdigit():
        name = f"jobs/{name}"
    output = args.output or (name.replace("/", "-") + ".png")
    try:
        if args.events:
            if args.events == "-":
                events = read_event_lines(sys.stdin, "stdin")
            else:
                try:
                    with open(args.events) as f:
                        events = read_event_lines(f, args.events)
                except OSError as e:
                    raise PlotError(f"--events {args.events!r}: cannot open ({e.strerror})") from e
        else:
            if not args.job:
                raise PlotError("name a job (jobs/N or N), or give --events")
            token = None
            if args.token_file:
                with open(args.token_file) as f:
                    token = next((l.strip() for l in f if l.strip() and not l.startswith("#")), None)
            elif os.environ.get("ODYSSEY_TOKEN"):
                token = os.environ["ODYSSEY_TOKEN"].strip()
            events = fetch_events(args.controller, name, token, args.tls_ca)
        s = series_of(events)
        render(s, output, name)
    except PlotError as e:
        print(f"odyssey-plot: {e}"[:4000], file=sys.stderr)
        return 2
    except Exception as e:  # an RPC failure: OdysseyError carries the status code
        code = getattr(e, "code", None)
        print(f"odyssey-plot: {e}"[:4000], file=sys.stderr)
        return 3 if code is not None and getattr(code, "name", "") == "NOT_FOUND" else 1
    print(f"{output}: {len(s.steps)} steps ({s.steps[0]}-{s.steps[-1]}) of {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
