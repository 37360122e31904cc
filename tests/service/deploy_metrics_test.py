#!/usr/bin/env python3
"""Checks deploy/prometheus and deploy/grafana against what the binaries really export.

A real odyssey-controller and a CPU odyssey-worker (the `tiny` model) on loopback ports picked at
run time run a short SFT job and an RL session (one ForwardBackward with sampler logprobs, one
OptimStep); while the session still runs (its per-job gauges exist only then), both /metrics
endpoints are scraped. Then every PromQL expression of deploy/grafana/odyssey.json (panel
targets, template variable queries) and deploy/prometheus/alerts.yml is parsed for its
`odyssey_*` series, and each must

  - be served with samples by the controller or the worker (a histogram's name only with
    `_bucket`, `_sum` or `_count`), by the process its `job="..."` matcher names (alerts; the
    dashboard selects targets with its $namespace and $job variables and hard-codes no job);
  - be used as its type allows: counters and histogram series only as range vectors inside
    rate/irate/increase (and `_bucket` only under histogram_quantile), gauges never in
    rate/irate/increase;
  - name only labels the series carries or the scrape config adds (job, instance, namespace,
    pod), in matchers and in by (...).

One meaning per name: no name but odyssey_build_info is served by both processes, and no series
carries a label of its own that collides with a target label (`job`: the per-job series use
`job_id`). The new series (per-job loss, gradient norm and learning rate, the TrainingService
latency histogram, odyssey_build_info) must be served, with the values the run gave them, and
shown by the dashboard (a loss panel among them).

It also checks that the files parse (JSON, YAML), that the dashboard has a current
schemaVersion, a Prometheus datasource variable used by every panel, and the worker and RL
session variables, that prometheus.yml's scrape jobs find the pods of deploy/kubernetes (app
label, prometheus.io/scrape annotation, container port named `metrics`), and that the checker
itself rejects an unknown metric and a gauge under rate(). `promtool check rules` checks
alerts.yml and `promtool test rules` makes each alert fire on synthetic series (ALERT_CASES:
quiet before its window and `for`, firing with the expected labels after); a missing promtool
fails the test (scripts/setup.sh installs it with Debian's prometheus). Not `promtool check config`:
Debian's promtool is built without Kubernetes service discovery and refuses prometheus.yml.

Every wait is on a condition with a deadline.
"""
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e_test import tiny_spec  # noqa: E402
from harness import Failure, arg_parser, parse_args, run_test  # noqa: E402
from rl_test import RlCluster  # noqa: E402

CONTROLLER, WORKER = "odyssey-controller", "odyssey-worker"  # prometheus.yml's job names
TARGET_LABELS = {"job", "instance", "namespace", "pod"}  # added by the scrape config
SHARED_NAMES = {"odyssey_build_info"}  # served by both processes, with one meaning: the process's build
DASHBOARD_JOB_VARIABLE = "$job"  # the dashboard's scrape-job variable (job=~"$job")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
COUNTER_FUNCS = {"rate", "irate", "increase"}
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


# ------------------------------------------------------------------------------------------
# The exposition format.

def scrape_text(port):
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def parse_exposition(text):
    """Returns ({family: type}, {sample name: set of label names}) of one /metrics page."""
    types, samples = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        elif line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s", line)
            if not m:
                raise Failure(f"unparsable /metrics line: {line!r}")
            labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(3) or ""))
            samples.setdefault(m.group(1), set()).update(labels)
    return types, samples


class Served:
    """What the two endpoints serve, as Prometheus with prometheus.yml stores it."""

    def __init__(self, pages):
        self.by_job = {}  # scrape job -> {sample name: (family type, label names)}
        self.collisions = []  # (scrape job, sample name, label) where a label of ours is a target label
        for job, text in pages.items():
            types, samples = parse_exposition(text)
            series = {}
            for name, labels in samples.items():
                family = name
                for suffix in HISTOGRAM_SUFFIXES:
                    if name.endswith(suffix) and types.get(name[: -len(suffix)]) == "histogram":
                        family = name[: -len(suffix)]
                self.collisions += [(job, name, l) for l in sorted(labels & TARGET_LABELS)]
                labels = labels | TARGET_LABELS
                series[name] = (types.get(family, "untyped"), labels, family != name)
            self.by_job[job] = series

    def lookup(self, name, job):
        """(type, labels, is_histogram_part) of `name` in scrape job `job` (None: either)."""
        jobs = [job] if job else list(self.by_job)
        found = [self.by_job[j][name] for j in jobs if j in self.by_job and name in self.by_job[j]]
        return found[0] if found else None

    def jobs_serving(self, name):
        return [j for j, s in self.by_job.items() if name in s]


# ------------------------------------------------------------------------------------------
# PromQL: enough of it to find the series an expression selects.

def strip_strings(expr):
    """The expression with the insides of string literals blanked (same length)."""
    return re.sub(r'"(?:[^"\\]|\\.)*"', lambda m: '"' + " " * (len(m.group(0)) - 2) + '"', expr)


def selectors(expr):
    """Yields (name, {label: value}, has_range, enclosing function, start) per odyssey_* selector."""
    bare = strip_strings(expr)
    for m in re.finditer(r"\b(odyssey_[a-zA-Z0-9_]+)\s*(\{[^}]*\})?\s*(\[[^\]]*\])?", bare):
        before = bare[: m.start()]
        if before.count("{") > before.count("}"):
            continue  # a label name inside a matcher (odyssey_job=~...)
        if re.search(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*$", before):
            continue  # a label name in a grouping clause
        matchers = {}
        if m.group(2):
            raw = expr[m.start(2): m.end(2)]  # the original text, strings included
            for lm in re.finditer(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', raw):
                matchers[lm.group(1)] = (lm.group(2), lm.group(3))
        func = re.search(r"([a-zA-Z_]+)\s*\(\s*$", before)
        yield m.group(1), matchers, bool(m.group(3)), func.group(1) if func else "", m.start()


def check_expr(where, expr, served, label_arg=None):
    """Returns the problems of one expression (empty: fine)."""
    problems = []
    found = list(selectors(expr))
    if not found and not re.search(r'\bup\{job="[^"]+"\}', expr):
        problems.append(f"{where}: no odyssey_* series (nor up{{job=...}}) in {expr!r}")
    known_labels = set()
    for name, matchers, has_range, func, _ in found:
        job = matchers.get("job")
        if job and job == ("=~", DASHBOARD_JOB_VARIABLE):
            job = None  # the dashboard's variable: any scrape job
        if job and (job[0] != "=" or job[1] not in served.by_job):
            problems.append(f"{where}: {name}{{job{job[0]}\"{job[1]}\"}}: job must be = one of {sorted(served.by_job)}")
            continue
        info = served.lookup(name, job[1] if job else None)
        if info is None:
            elsewhere = served.jobs_serving(name)
            problems.append(f"{where}: {name} is not served" + (f" by {job[1]} (only by {elsewhere})" if job and elsewhere else ""))
            continue
        if not job and len(served.jobs_serving(name)) > 1 and name not in SHARED_NAMES:
            problems.append(f"{where}: {name} is served by both {served.jobs_serving(name)}: name one with job=\"...\"")
        kind, labels, histogram_part = info
        known_labels |= labels
        if kind == "histogram" and not histogram_part:
            problems.append(f"{where}: {name} is a histogram: use {name}_bucket / _sum / _count")
        elif kind == "counter" or histogram_part:
            if not has_range or func not in COUNTER_FUNCS:
                problems.append(f"{where}: {name} is a {kind}: use it as rate/irate/increase({name}[...]), not {func or 'bare'}")
            if name.endswith("_bucket") and "histogram_quantile" not in expr:
                problems.append(f"{where}: {name} outside histogram_quantile")
        elif kind == "gauge" and (func in COUNTER_FUNCS or (has_range and not func.endswith("_over_time")
                                                           and func not in ("deriv", "delta", "predict_linear"))):
            problems.append(f"{where}: {name} is a gauge: {func}() of it means nothing")
        for label in matchers:
            if label not in labels:
                problems.append(f"{where}: {name} has no label {label!r} (it has {sorted(labels)})")
        if label_arg and label_arg not in labels:
            problems.append(f"{where}: label_values: {name} has no label {label_arg!r}")
    for gm in GROUPING.finditer(strip_strings(expr)):
        for label in filter(None, (l.strip() for l in gm.group(2).split(","))):
            if label not in known_labels | {"le"}:
                problems.append(f"{where}: {gm.group(1)} ({label}): no series of the expression has it")
    return problems


# ------------------------------------------------------------------------------------------
# The files.

def load_files(source_dir):
    import yaml

    deploy = os.path.join(source_dir, "deploy")
    with open(os.path.join(deploy, "grafana", "odyssey.json")) as f:
        dashboard = json.load(f)
    with open(os.path.join(deploy, "prometheus", "alerts.yml")) as f:
        alerts = yaml.safe_load(f)
    with open(os.path.join(deploy, "prometheus", "prometheus.yml")) as f:
        prometheus = yaml.safe_load(f)
    manifests = []
    for name in ("controller.yaml", "workers.yaml"):
        with open(os.path.join(deploy, "kubernetes", name)) as f:
            manifests += [d for d in yaml.safe_load_all(f) if d]
    return dashboard, alerts, prometheus, manifests


def expressions(dashboard, alerts):
    """[(where, expr, label_values label or None)] of the dashboard and the rules."""
    out = []

    def panels(ps):
        for p in ps:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dashboard["panels"]):
        for t in p.get("targets", []):
            out.append((f"panel {p['title']!r} {t.get('refId')}", t["expr"], None))
    for v in dashboard["templating"]["list"]:
        if v["type"] != "query":
            continue
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        m = re.fullmatch(r"\s*label_values\((.*),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*", q)
        if not m:
            raise Failure(f"variable {v['name']}: query {q!r} is not label_values(series, label)")
        out.append((f"variable ${v['name']}", m.group(1), m.group(2)))
    for group in alerts["groups"]:
        for rule in group["rules"]:
            out.append((f"alert {rule.get('alert') or rule.get('record')}", rule["expr"], None))
    return out


def check_dashboard_shape(dashboard):
    problems = []
    if dashboard.get("schemaVersion", 0) < 36:
        problems.append(f"schemaVersion {dashboard.get('schemaVersion')}: want a current Grafana's (>= 36)")
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    ds = variables.get("datasource")
    if not ds or ds["type"] != "datasource" or ds["query"] != "prometheus":
        problems.append("no Prometheus datasource variable named `datasource`")
    for name in ("namespace", "job", "worker", "job_id"):
        if name not in variables:
            problems.append(f"no template variable ${name}")
    # Templated on the namespace and scrape job: no expression hard-codes a scrape job.
    text = json.dumps(dashboard)
    for hard in re.findall(r'job=\\"[^$\\][^\\]*\\"', text):
        problems.append(f"the dashboard hard-codes {hard} (use job=~\"$job\")")
    titles = {p["title"]: p for p in dashboard["panels"]}
    loss = titles.get("Loss by job")
    if not loss or "odyssey_job_loss" not in json.dumps(loss.get("targets")):
        problems.append("no panel 'Loss by job' over odyssey_job_loss")
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    for want in ("Cluster", "Training", "Memory", "RL sessions"):
        if want not in rows:
            problems.append(f"no row {want!r} (rows: {rows})")
    for p in dashboard["panels"]:
        if p["type"] != "row" and p.get("datasource", {}).get("uid") != "${datasource}":
            problems.append(f"panel {p['title']!r} does not use the $datasource variable")
    return problems


def check_scrape_config(prometheus, manifests, alerts):
    """prometheus.yml's jobs keep exactly the pods the manifests make, on their metrics port."""
    problems = []
    jobs = {j["job_name"]: j for j in prometheus["scrape_configs"]}
    if set(jobs) != {CONTROLLER, WORKER}:
        problems.append(f"scrape jobs {sorted(jobs)}, want {[CONTROLLER, WORKER]}")
    for rule_file in prometheus.get("rule_files", []):
        if rule_file != "alerts.yml":
            problems.append(f"rule_files names {rule_file!r}")
    for d in manifests:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        app = d["spec"]["template"]["metadata"]["labels"]["app"]
        annotations = d["spec"]["template"]["metadata"].get("annotations", {})
        ports = [p for c in d["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
        meta = {"__meta_kubernetes_pod_label_app": app,
                "__meta_kubernetes_pod_annotation_prometheus_io_scrape": annotations.get("prometheus.io/scrape", "")}
        kept_by = []
        for job_name, job in jobs.items():
            for port in ports:
                m = dict(meta, __meta_kubernetes_pod_container_port_name=port.get("name", ""))
                keep = all(re.fullmatch(r["regex"], ";".join(m.get(s, "") for s in r["source_labels"]))
                           for r in job["relabel_configs"] if r.get("action") == "keep")
                if keep:
                    kept_by.append((job_name, port["containerPort"]))
        if kept_by != [(app, int(annotations.get("prometheus.io/port", -1)))]:
            problems.append(f"{d['kind']} {d['metadata']['name']}: scraped as {kept_by}, want one target in job "
                            f"{app} on its metrics port ({annotations.get('prometheus.io/port')})")
        if d["kind"] == "StatefulSet":
            svc = [s for s in manifests if s["kind"] == "Service" and s["metadata"]["name"] == d["spec"]["serviceName"]]
            if not svc or svc[0]["spec"].get("clusterIP") != "None":
                problems.append(f"StatefulSet {d['metadata']['name']}: no headless Service {d['spec']['serviceName']!r}")
    for group in alerts["groups"]:
        for rule in group["rules"]:
            for job in re.findall(r'\bjob="([^"]*)"', rule["expr"]):
                if job not in jobs:
                    problems.append(f"alert {rule['alert']}: job {job!r} is no scrape job")
            if not rule.get("annotations", {}).get("description"):
                problems.append(f"alert {rule['alert']}: no description")
    return problems


# Synthetic series (one a minute) per alert: it must fire with these labels at `fires`, and
# not at `quiet` (before its `for` or its window has passed, or on healthy values).
C, W = 'job="odyssey-controller", pod="c"', 'job="odyssey-worker", pod="w0"'
ALERT_CASES = {
    "OdysseyControllerDown": ([("up{%s}" % C, "1 1 0x20")], "10m", "3m", {}),
    "OdysseyWorkerDown": ([("up{%s}" % W, "1 1 0x20")], "10m", "3m", {"job": WORKER, "pod": "w0"}),
    "OdysseyWorkerDisconnected": ([("odyssey_worker_connected{%s}" % W, "1 1 0x20")], "10m", "3m",
                                  {"job": WORKER, "pod": "w0"}),
    "OdysseyJobRestartsClimbing": ([("odyssey_job_restarts_total{%s}" % C, "0 0 0 1 2 3 4 5 6")], "8m", "4m",
                                   {"job": CONTROLLER, "pod": "c"}),
    # Steps and tokens move for 10 minutes, then stop while the worker stays busy.
    "OdysseyJobStalled": ([("odyssey_worker_busy{%s}" % W, "1x40"), ("odyssey_steps_total{%s}" % W, "0+1x10 10x30"),
                           ("odyssey_worker_tokens_total{%s}" % W, "0+100x10 1000x30")], "35m", "20m",
                          {"job": WORKER, "pod": "w0"}),
    "OdysseyRlLogprobMismatchHigh": ([('odyssey_rl_logprob_mismatch_max{%s, job_id="3"}' % C, "0.5 0.5 3x20")],
                                     "15m", "5m", {"job": CONTROLLER, "pod": "c", "job_id": "3"}),
    # 80e9 of an 85e9-byte device while busy (fires), then the job ends and the gauge keeps its
    # value (quiet).
    "OdysseyGpuMemoryNearCapacity": ([("odyssey_gpu_memory_peak_bytes{%s}" % W, "40e9 40e9 80e9x5"),
                                      ("odyssey_gpu_memory_capacity_bytes{%s}" % W, "85e9x6"),
                                      ("odyssey_worker_busy{%s}" % W, "1 1 1 1 0 0")], "2m", "5m",
                                     {"job": WORKER, "pod": "w0"}),
    "OdysseyTrainingCallErrors": ([('odyssey_training_calls_total{%s, method="OptimStep", code="OK"}' % C, "0+10x40"),
                                   ('odyssey_training_calls_total{%s, method="OptimStep", code="INVALID_ARGUMENT"}' % C,
                                    "0x10 0+5x30")], "30m", "12m", {}),
}


def promtool(source_dir, alerts, workdir):
    """`promtool check rules alerts.yml`, and each alert fires on its ALERT_CASES series."""
    tool = shutil.which("promtool")
    if not tool:
        return ["promtool is not installed (scripts/setup.sh installs the Debian package prometheus): "
                "cannot check alerts.yml or fire its alerts"]
    import yaml

    problems = []
    rules = os.path.join(source_dir, "deploy", "prometheus", "alerts.yml")
    out = subprocess.run([tool, "check", "rules", rules], capture_output=True, text=True, timeout=60)
    print(f"promtool check rules alerts.yml: exit {out.returncode}")
    if out.returncode != 0:
        problems.append(f"promtool check rules: {out.stdout}{out.stderr}")
    # promtool compares annotations verbatim: test a copy without them.
    alerts = copy.deepcopy(alerts)
    names = [r["alert"] for g in alerts["groups"] for r in g["rules"]]
    for g in alerts["groups"]:
        for r in g["rules"]:
            r.pop("annotations", None)
    with open(os.path.join(workdir, "alerts.yml"), "w") as f:
        yaml.safe_dump(alerts, f)
    tests = []
    for name in names:
        if name not in ALERT_CASES:
            problems.append(f"alert {name} has no firing test in ALERT_CASES")
            continue
        series, fires, quiet, labels = ALERT_CASES[name]
        severity = next(r["labels"]["severity"] for g in alerts["groups"] for r in g["rules"] if r["alert"] == name)
        tests.append({"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series],
                      "alert_rule_test": [
                          {"eval_time": quiet, "alertname": name, "exp_alerts": []},
                          {"eval_time": fires, "alertname": name,
                           "exp_alerts": [{"exp_labels": dict(labels, severity=severity)}]}]})
    with open(os.path.join(workdir, "alerts_test.yml"), "w") as f:
        yaml.safe_dump({"rule_files": ["alerts.yml"], "evaluation_interval": "1m", "tests": tests}, f)
    out = subprocess.run([tool, "test", "rules", "alerts_test.yml"], cwd=workdir, capture_output=True, text=True,
                         timeout=60)
    print(f"promtool test rules ({len(tests)} alerts, each quiet then firing): exit {out.returncode}")
    if out.returncode != 0:
        problems.append(f"promtool test rules: {out.stdout}{out.stderr}")
    return problems


# ------------------------------------------------------------------------------------------

def run_cluster(c):
    """SFT job to the end, then an RL session left RUNNING; returns both /metrics pages."""
    c.start_controller()
    worker_port = c.start_worker("w1")
    sft = c.submit(tiny_spec(steps=6, every=3))
    job = c.wait_state(sft, "SUCCEEDED")
    print(f"SFT {sft}: SUCCEEDED at step {job.step}, loss {job.loss:.3f}")

    rl = c.session()
    batch = c.batch(seed=1, n=2, length=17)
    logp = c.forward(rl, batch)
    # Sampler logprobs 0.25 nats below the trainer's: the mismatch gauges get a known value.
    sampled = [c.datum(list(d.tokens) + [d.target_tokens[-1]], sampler_logprobs=[x - 0.25 for x in lp],
                       advantages=[1.0] * len(lp)) for d, lp in zip(batch, logp)]
    r = c.fb(rl, sampled, "importance_sampling")
    s = c.step(rl)
    print(f"RL {rl}: ForwardBackward mismatch mean {r.mismatch_mean:.3f} max {r.mismatch_max:.3f} over "
          f"{r.mismatch_tokens} tokens; OptimStep -> step {s.step}")
    if r.mismatch_tokens == 0 or s.step != 1:
        raise Failure(f"the RL session did not report a mismatch ({r.mismatch_tokens} tokens) or step {s.step}")
    c.jobs.ListJobs(c.pb.ListJobsRequest(), timeout=10)  # a JobService call for the latency histogram
    pages = {CONTROLLER: scrape_text(c.metrics_port), WORKER: scrape_text(worker_port)}
    job_id = rl.split("/")[-1]
    values = scrape_values(pages[CONTROLLER])
    want = {f'odyssey_rl_optimizer_step{{job_id="{job_id}"}}': 1,
            f'odyssey_job_loss{{job_id="{job_id}"}}': r.loss,
            f'odyssey_job_grad_norm{{job_id="{job_id}"}}': s.grad_norm,
            f'odyssey_job_learning_rate{{job_id="{job_id}"}}': s.lr,
            'odyssey_training_call_duration_seconds_count{method="ForwardBackward"}': 1,
            'odyssey_training_call_duration_seconds_count{method="OptimStep"}': 1,
            'odyssey_training_call_duration_seconds_count{method="Forward"}': 1}
    for series, value in want.items():
        got = values.get(series)
        print(f"controller: {series} = {got} (want {value:.6g})")
        if got is None or abs(got - value) > 1e-6 * max(1.0, abs(value)):
            raise Failure(f"the controller serves {series} = {got}, want {value}")
    for job, text in pages.items():
        info = [line for line in text.splitlines() if line.startswith("odyssey_build_info{")]
        print(f"{job}: {info}")
        if len(info) != 1 or not re.fullmatch(r'odyssey_build_info\{revision="[^"]*",version="\d+\.\d+\.\d+"\} 1', info[0]):
            raise Failure(f"{job} serves {info} as odyssey_build_info")
    # The SFT job's per-job series ended with it.
    if f'job_id="{sft.split("/")[-1]}"' in pages[CONTROLLER]:
        raise Failure(f"the controller still serves series of {sft}, which ended")
    return pages


def scrape_values(text):
    """{'name{labels}': value} of one /metrics page."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            out[series] = float(value)
    return out


def check_all(c):
    """The whole test on RlCluster c; Failure listing every problem found."""
    source_dir = c.args.source_dir
    problems = []
    dashboard, alerts, prometheus, manifests = load_files(source_dir)
    exprs = expressions(dashboard, alerts)
    print(f"parsed odyssey.json ({len(exprs)} expressions with the rules), alerts.yml "
          f"({sum(len(g['rules']) for g in alerts['groups'])} rules), prometheus.yml, {len(manifests)} manifests")
    problems += check_dashboard_shape(dashboard)
    problems += check_scrape_config(prometheus, manifests, alerts)
    os.makedirs(os.path.join(c.workdir, "promtool"))
    problems += promtool(source_dir, alerts, os.path.join(c.workdir, "promtool"))

    served = Served(run_cluster(c))
    for job, series in served.by_job.items():
        print(f"{job} serves {len(series)} series names")
    # The checker must be able to fail: an unknown series, a gauge under rate(), a name both
    # processes serve without job="...", a bare histogram, a label the series lacks.
    for bad in ('rate(odyssey_no_such_total[5m])', 'rate(odyssey_worker_busy{job="odyssey-worker"}[5m])',
                'odyssey_tokens_total', 'odyssey_step_duration_seconds_count{job="odyssey-worker"}',
                'rate(odyssey_step_duration_seconds[5m])', 'sum by (method) (odyssey_queue_depth)',
                'odyssey_job_loss{job=~"odyssey-.*"}', 'odyssey_job_loss{job_id="1", odyssey_job="jobs/1"}'):
        if not check_expr("self-check", bad, served):
            problems.append(f"the checker accepts {bad!r}")
    # One meaning per name: a name is one process kind's, and no label of ours is a target label.
    for name in sorted(set(served.by_job[CONTROLLER]) & set(served.by_job[WORKER])):
        if name not in SHARED_NAMES:
            problems.append(f"{name} is served by both the controller and the worker (one name, one meaning)")
    for job, name, label in served.collisions:
        problems.append(f"{job} serves {name} with a label {label!r}, which the scrape's target label replaces")
    used = set()
    for where, expr, label in exprs:
        problems += check_expr(where, expr, served, label)
        used |= {sel[0] for sel in selectors(expr)}
    print(f"{len(used)} odyssey series used: {', '.join(sorted(used))}")
    for name in ("odyssey_job_loss", "odyssey_job_grad_norm", "odyssey_job_learning_rate",
                 "odyssey_training_call_duration_seconds_bucket", "odyssey_build_info"):
        if name not in used:
            problems.append(f"the dashboard does not show {name}")
    if problems:
        raise Failure(f"{len(problems)} problem(s):\n  " + "\n  ".join(problems))


def main():
    args = parse_args(arg_parser())
    args.cli = ""  # Cluster.submit: through gRPC
    outcome = run_test("deploy_metrics", "odyssey-deploy-metrics-", args.keep, lambda workdir: RlCluster(args, workdir),
                       check_all)
    return 0 if outcome == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
