#!/usr/bin/env python3
"""deploy/ without a cluster or a container registry (ctest `deploy_manifests`):

1. The Dockerfiles of deploy/docker pass scripts/dockerfile_lint.py (pinned bases, multi-stage,
   non-root, HEALTHCHECK, no ADD of URLs, apt hygiene), and the linter fails each rule on a
   Dockerfile that breaks it (so a passing lint means something).
2. The kustomize base (deploy/kubernetes) and both overlays render (scripts/kustomize.py, the
   subset of `kubectl kustomize` they use; the renderer's refusals are checked too), and every
   object, rendered or as written (secrets.example.yaml included), validates against the
   Kubernetes schemas of 1.28 and 1.37 with kubernetes-validate in strict mode (unknown fields
   are errors).
3. What the overlays are for holds in their output: the gpu overlay asks one nvidia.com/gpu per
   worker and trains on cuda:0; the cpu-demo overlay asks no GPU, trains on cpu, has no TLS,
   token or Secret left, and probes the plaintext controller with kubelet's gRPC probe.
4. Images and probes agree: the manifests name the images the Dockerfiles document (tag = the
   project version), every volume a container mounts exists, the liveness probes and the
   Dockerfiles' HEALTHCHECKs ask the /healthz of the port the process serves metrics on
   (--metrics-listen), which the manifest and the image expose.

    python3 tests/deploy/deploy_test.py --source-dir .
"""
import argparse
import copy
import os
import re
import sys

import yaml

VERSIONS = ("1.28", "1.37")


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


def lint_dockerfiles(src, lint_mod):
    docker = os.path.join(src, "deploy", "docker")
    files = sorted(f for f in os.listdir(docker) if f.endswith(".Dockerfile"))
    check(set(files) >= {"controller.Dockerfile", "worker.Dockerfile"}, f"deploy/docker has {files}")
    texts = {}
    for f in files:
        with open(os.path.join(docker, f)) as fh:
            texts[f] = fh.read()
        findings = lint_mod.lint(texts[f], f)
        check(not findings, f"{f}: {findings}")
    print(f"ok: {len(files)} Dockerfiles pass the lint")

    good = texts["controller.Dockerfile"]
    # Each mutation of a passing Dockerfile must be caught by the rule named.
    bad = {
        "pinned-base": [good.replace("FROM debian:12.8-slim AS unpack", "FROM debian AS unpack"),
                        good.replace("FROM debian:12.8-slim\n", "FROM debian:latest\n"),
                        good.replace("FROM debian:12.8-slim\n", "FROM ${BASE}\n")],
        "multi-stage": [good.replace("COPY --from=unpack", "COPY --from=builder"),
                        "FROM debian:12.8-slim\nUSER 1000\nHEALTHCHECK CMD true\n"],
        "non-root": [good.replace("USER 10001:10001", "USER root"), good.replace("USER 10001:10001", "USER 0:0"),
                     good.replace("USER 10001:10001", "")],
        "healthcheck": [re.sub(r"HEALTHCHECK[^\n]*\\\n[^\n]*\n", "", good),
                        re.sub(r"HEALTHCHECK[^\n]*\\\n[^\n]*\n", "HEALTHCHECK NONE\n", good)],
        "no-add-url": [good.replace("COPY ${ODYSSEY_PACKAGE}-odyssey.tar.gz /tmp/",
                                    "ADD https://example.org/odyssey.tar.gz /tmp/")],
        "apt-hygiene": [good.replace(" --no-install-recommends", ""), good.replace(" && rm -rf /var/lib/apt/lists/*", "")],
    }
    n = 0
    for rule, texts_bad in bad.items():
        for i, t in enumerate(texts_bad):
            check(t != good, f"mutation {rule}[{i}] did not change the Dockerfile (the test is stale)")
            rules = {f.split(": ")[1] for f in lint_mod.lint(t, "bad")}
            check(rule in rules, f"the lint misses {rule} on mutation {i}: found {rules}")
            n += 1
    print(f"ok: the lint catches all {n} broken Dockerfiles, each by its rule")
    return texts


def containers(obj):
    spec = obj.get("spec", {}).get("template", {}).get("spec", {})
    return spec, spec.get("containers", [])


def flag(args, name):
    for a in args:
        if a.startswith(f"--{name}="):
            return a.split("=", 1)[1]
    return None


def check_objects(label, objs, kv, version):
    for o in objs:
        for v in VERSIONS:
            try:
                kv.validate(copy.deepcopy(o), v, True)
            except Exception as e:  # ValidationError, SchemaNotFoundError: both mean "not valid"
                raise Failure(f"{label}: {o['kind']}/{o['metadata']['name']} fails Kubernetes {v} (strict): "
                              f"{getattr(e, 'message', e)}")
    by = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    for (kind, name), o in by.items():
        if kind not in ("Deployment", "StatefulSet"):
            continue
        spec, cs = containers(o)
        check(spec.get("securityContext", {}).get("runAsNonRoot") is True, f"{label}: {name} may run as root")
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for c in cs:
            for m in c.get("volumeMounts", []):
                check(m["name"] in volumes, f"{label}: {name} mounts volume {m['name']!r}, which it does not declare")
            image = c["image"]
            check(re.fullmatch(rf"odyssey-(controller|worker):{re.escape(version)}(-cpu)?", image),
                  f"{label}: {name} runs image {image!r}, not odyssey-controller/odyssey-worker:{version}[-cpu]")
            ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
            metrics = flag(c.get("args", []), "metrics-listen")
            check(metrics and int(metrics.rsplit(":", 1)[1]) == ports.get("metrics"),
                  f"{label}: {name} serves metrics on {metrics}, its port 'metrics' is {ports.get('metrics')}")
            live = c.get("livenessProbe", {}).get("httpGet", {})
            check(live.get("path") == "/healthz" and live.get("port") == "metrics",
                  f"{label}: {name}'s liveness probe is {live}, not /healthz on the metrics port")
        for s in spec.get("volumes", []):
            if "secret" in s:
                check(s["secret"]["secretName"] in {x["metadata"]["name"] for x in SECRETS},
                      f"{label}: {name} mounts Secret {s['secret']['secretName']!r}, which secrets.example.yaml lacks")
    print(f"ok: {label}: {len(objs)} objects valid against Kubernetes {' and '.join(VERSIONS)} (strict); "
          "mounts, images, probes agree")
    return by


SECRETS = []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--source-dir", required=True)
    src = os.path.abspath(ap.parse_args().source_dir)
    sys.path.insert(0, os.path.join(src, "scripts"))
    import dockerfile_lint
    import kustomize
    try:
        import kubernetes_validate as kv
    except ImportError:
        print("FAILED: kubernetes-validate is not installed (scripts/setup.sh installs it into .venv)")
        return 1
    with open(os.path.join(src, "CMakeLists.txt")) as f:
        version = re.search(r"project\(odyssey VERSION (\S+)", f.read()).group(1)
    try:
        texts = lint_dockerfiles(src, dockerfile_lint)
        k8s = os.path.join(src, "deploy", "kubernetes")
        raw = []
        for f in sorted(os.listdir(k8s)):
            if f.endswith(".yaml") and f != "kustomization.yaml":
                with open(os.path.join(k8s, f)) as fh:
                    docs = [d for d in yaml.safe_load_all(fh) if d]
                if f == "secrets.example.yaml":
                    SECRETS.extend(docs)
                raw += docs
        for o in raw:
            for v in VERSIONS:
                try:
                    kv.validate(copy.deepcopy(o), v, True)
                except Exception as e:
                    raise Failure(f"{o['kind']}/{o['metadata']['name']} as written fails Kubernetes {v}: {e}")
        print(f"ok: the {len(raw)} objects of deploy/kubernetes/*.yaml as written are valid (strict)")

        base = check_objects("base", kustomize.render(k8s), kv, version)
        gpu = check_objects("overlays/gpu", kustomize.render(os.path.join(k8s, "overlays", "gpu")), kv, version)
        demo = check_objects("overlays/cpu-demo", kustomize.render(os.path.join(k8s, "overlays", "cpu-demo")), kv,
                             version)
        check(set(base) == set(gpu) == set(demo), "the overlays do not render the base's objects")

        _, (w,) = containers(gpu[("StatefulSet", "odyssey-worker")])
        check(w.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") == 1, "gpu: no nvidia.com/gpu limit of 1")
        check(flag(w["args"], "device") == "cuda:0", f"gpu: worker device {flag(w['args'], 'device')}")
        check(w["image"] == f"odyssey-worker:{version}", f"gpu: worker image {w['image']}")
        check(flag(w["args"], "tls-ca"), "gpu: the worker lost its TLS")
        print("ok: gpu overlay: one nvidia.com/gpu per worker, --device=cuda:0, TLS kept")

        text = yaml.safe_dump_all(list(demo.values()))
        check("nvidia.com/gpu" not in text, "cpu-demo asks for a GPU")
        for word in ("--tls", "--token-file", "--auth-token-file", "secretName"):
            check(word not in text, f"cpu-demo still has {word}")
        wspec, (w,) = containers(demo[("StatefulSet", "odyssey-worker")])
        check(flag(w["args"], "device") == "cpu" and w["image"] == f"odyssey-worker:{version}-cpu",
              f"cpu-demo worker: {flag(w['args'], 'device')} {w['image']}")
        check(demo[("StatefulSet", "odyssey-worker")]["spec"]["replicas"] == 1, "cpu-demo: not one worker")
        _, (c,) = containers(demo[("Deployment", "odyssey-controller")])
        listen = int(flag(c["args"], "listen").rsplit(":", 1)[1])
        check(c["readinessProbe"].get("grpc", {}).get("port") == listen,
              f"cpu-demo: readiness {c['readinessProbe']} is not a gRPC probe of --listen's port {listen}")
        for o in demo.values():
            if o["kind"] == "PersistentVolumeClaim":
                check(o["spec"]["accessModes"] == ["ReadWriteOnce"], f"cpu-demo: {o['metadata']['name']} not RWO")
        print("ok: cpu-demo overlay: no GPU, --device=cpu, no TLS/tokens/Secrets, gRPC readiness probe, RWO volumes")

        # The images' HEALTHCHECK asks what the manifests' liveness probes ask, on the port exposed.
        for df, kind, name in (("controller.Dockerfile", "Deployment", "odyssey-controller"),
                               ("worker.Dockerfile", "StatefulSet", "odyssey-worker")):
            _, (c,) = containers(base[(kind, name)])
            port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
            t = texts[df]
            check(re.search(rf"HEALTHCHECK [^\n]*\\\n\s*CMD curl -fsS http://127\.0\.0\.1:{port}/healthz", t),
                  f"{df}: HEALTHCHECK does not ask /healthz on {port}")
            check(re.search(rf"^EXPOSE [^\n]*\b{port}\b", t, re.M), f"{df}: does not EXPOSE {port}")
            check(f"--metrics-listen=0.0.0.0:{port}" in t, f"{df}: its CMD does not serve metrics on {port}")
            check(f"-t {name}:{version}" in t, f"{df}: does not document the tag {name}:{version}")
        print("ok: the images' HEALTHCHECKs, EXPOSEs and CMDs match the manifests' probes and ports")

        # The renderer refuses what it does not implement, and a failing JSON 6902 test stops it.
        for bad_ops, want in (([{"op": "test", "path": "/a", "value": 2}], "test failed"),
                              ([{"op": "remove", "path": "/b/3"}], "no element"),
                              ([{"op": "frobnicate", "path": "/a"}], "unknown op")):
            try:
                kustomize.apply_json6902({"a": 1, "b": [0]}, bad_ops, "t")
                raise Failure(f"kustomize.py applied {bad_ops}")
            except kustomize.KustomizeError as e:
                check(want in str(e), f"kustomize.py: {e} does not say {want!r}")
        doc = {"a": [1, 2]}
        kustomize.apply_json6902(doc, [{"op": "add", "path": "/a/1", "value": 9}, {"op": "add", "path": "/a/-", "value": 3},
                                       {"op": "replace", "path": "/a/0", "value": 0}], "t")
        check(doc == {"a": [0, 9, 2, 3]}, f"kustomize.py: JSON 6902 add/replace gave {doc}")
        print("ok: scripts/kustomize.py: JSON 6902 semantics and refusals")
    except (Failure, kustomize.KustomizeError) as e:
        print(f"FAILED: {e}")
        return 1
    print("deploy_manifests: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
