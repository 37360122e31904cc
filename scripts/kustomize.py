#!/usr/bin/env python3
"""Renders a kustomization the way `kubectl kustomize DIR` does, for the subset of kustomize that
deploy/kubernetes uses, where kubectl is not installed (CI; Debian 12 has no kustomize package).

    python3 scripts/kustomize.py deploy/kubernetes/overlays/cpu-demo          # YAML on stdout
    python3 scripts/kustomize.py deploy/kubernetes/overlays/gpu | kubectl apply -f -

The overlays are plain kustomize: `kubectl apply -k DIR` applies them without this script.

Supported kustomization.yaml fields (anything else is refused, naming the field, rather than
silently ignored):
  resources   files (one or more YAML documents) and folders holding a kustomization.yaml,
              relative to the kustomization's folder, in order
  patches     JSON 6902 patches (a YAML list of operations: add, remove, replace, move, copy,
              test), inline (`patch:`) or in a file (`path:`), applied to every resource that
              `target` selects (kind, name, group, version, namespace; exact matches). Strategic
              merge patches (a patch that is a mapping) are refused.
  replicas    [{name, count}]: spec.replicas of the Deployments / StatefulSets of that name
  images      [{name, newName, newTag, digest}]: every container's image whose name (the part
              before the tag or digest) is `name`
Order, as kustomize's: the resources (each folder rendered with its own kustomization first),
then this level's patches, replicas and images. The output is sorted by kind as kubectl's
default ("legacy") order does (namespaces and storage first, workloads last).

Also importable: render(folder) returns the list of objects.
"""
import copy
import os
import sys

import yaml

_FIELDS = {"apiVersion", "kind", "resources", "patches", "replicas", "images"}
_KIND_ORDER = ["Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition", "ServiceAccount",
               "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ConfigMap",
               "Secret", "Endpoints", "Service", "LimitRange", "PriorityClass", "PersistentVolume",
               "PersistentVolumeClaim", "Deployment", "StatefulSet", "CronJob", "PodDisruptionBudget"]
_KIND_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]


class KustomizeError(Exception):
    """A kustomization this renderer cannot render (or kustomize would refuse); names the file."""


def _load_yaml_docs(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def _kustomization_file(folder):
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        p = os.path.join(folder, name)
        if os.path.isfile(p):
            return p
    raise KustomizeError(f"{folder}: no kustomization.yaml")


def _res_id(obj):
    meta = obj.get("metadata") or {}
    return (obj.get("apiVersion"), obj.get("kind"), meta.get("namespace"), meta.get("name"))


# --- JSON 6902 ----------------------------------------------------------------------------------

def _pointer(path, where):
    if path == "":
        return []
    if not path.startswith("/"):
        raise KustomizeError(f"{where}: path {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _child(node, key, where, path):
    if isinstance(node, list):
        if not key.isdigit() or int(key) >= len(node):
            raise KustomizeError(f"{where}: path {path!r}: no element {key!r} (list of {len(node)})")
        return node[int(key)]
    if isinstance(node, dict):
        if key not in node:
            raise KustomizeError(f"{where}: path {path!r}: no key {key!r}")
        return node[key]
    raise KustomizeError(f"{where}: path {path!r}: {key!r} is below a scalar")


def _parent(doc, path, where):
    parts = _pointer(path, where)
    if not parts:
        raise KustomizeError(f"{where}: an operation on the whole document is not supported")
    node = doc
    for key in parts[:-1]:
        node = _child(node, key, where, path)
    return node, parts[-1]


def _get(doc, path, where):
    node = doc
    for key in _pointer(path, where):
        node = _child(node, key, where, path)
    return node


def _add(doc, path, value, where):
    parent, key = _parent(doc, path, where)
    if isinstance(parent, list):
        if key == "-":
            parent.append(value)
        elif key.isdigit() and int(key) <= len(parent):
            parent.insert(int(key), value)
        else:
            raise KustomizeError(f"{where}: add at {path!r}: index {key!r} out of range (list of {len(parent)})")
    elif isinstance(parent, dict):
        parent[key] = value
    else:
        raise KustomizeError(f"{where}: add at {path!r}: parent is a scalar")


def _remove(doc, path, where):
    parent, key = _parent(doc, path, where)
    _child(parent, key, where, path)  # must exist
    if isinstance(parent, list):
        return parent.pop(int(key))
    return parent.pop(key)


def apply_json6902(doc, ops, where):
    """Applies the RFC 6902 operations `ops` to `doc` in place (errors name `where`)."""
    if not isinstance(ops, list):
        raise KustomizeError(f"{where}: a JSON 6902 patch is a list of operations")
    for i, op in enumerate(ops):
        at = f"{where}: operation {i}"
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise KustomizeError(f"{at}: needs 'op' and 'path'")
        kind, path = op["op"], op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise KustomizeError(f"{at}: {kind} needs 'value'")
        if kind == "add":
            _add(doc, path, copy.deepcopy(op["value"]), at)
        elif kind == "remove":
            _remove(doc, path, at)
        elif kind == "replace":
            _remove(doc, path, at)
            _add(doc, path, copy.deepcopy(op["value"]), at)
        elif kind == "test":
            if _get(doc, path, at) != op["value"]:
                raise KustomizeError(f"{at}: test failed: {path!r} is {_get(doc, path, at)!r}, not {op['value']!r}")
        elif kind in ("move", "copy"):
            if "from" not in op:
                raise KustomizeError(f"{at}: {kind} needs 'from'")
            value = copy.deepcopy(_get(doc, op["from"], at))
            if kind == "move":
                _remove(doc, op["from"], at)
            _add(doc, path, value, at)
        else:
            raise KustomizeError(f"{at}: unknown op {kind!r}")


# --- transformers -------------------------------------------------------------------------------

def _matches(obj, target):
    group, _, version = (obj.get("apiVersion") or "").rpartition("/")
    meta = obj.get("metadata") or {}
    have = {"kind": obj.get("kind"), "name": meta.get("name"), "namespace": meta.get("namespace"),
            "group": group, "version": version}
    return all(have[k] == v for k, v in target.items())


def _apply_patches(objs, patches, folder, where):
    for i, p in enumerate(patches):
        at = f"{where}: patches[{i}]"
        unknown = set(p) - {"path", "patch", "target"}
        if unknown:
            raise KustomizeError(f"{at}: unsupported field(s) {sorted(unknown)}")
        if ("path" in p) == ("patch" in p):
            raise KustomizeError(f"{at}: give exactly one of 'path' and 'patch'")
        ops = yaml.safe_load(open(os.path.join(folder, p["path"])) if "path" in p else p["patch"])
        if isinstance(ops, dict):
            raise KustomizeError(f"{at}: strategic merge patches are not supported here; write a JSON 6902 "
                                 "patch (a list of operations) with a target")
        target = p.get("target")
        if not isinstance(target, dict) or not target:
            raise KustomizeError(f"{at}: a JSON 6902 patch needs a target")
        bad = set(target) - {"kind", "name", "namespace", "group", "version"}
        if bad:
            raise KustomizeError(f"{at}: target field(s) {sorted(bad)} are not supported")
        hits = [o for o in objs if _matches(o, target)]
        if not hits:
            raise KustomizeError(f"{at}: target {target} selects no resource")
        for o in hits:
            apply_json6902(o, ops, f"{at} on {o['kind']}/{o['metadata']['name']}")


def _split_image(ref):
    """'repo/name:tag@sha256:x' -> (name, tag, digest); a ':' in the registry's host:port is kept."""
    name, _, digest = ref.partition("@")
    tag = ""
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return name, tag, digest


def _images(node, rules):
    if isinstance(node, dict):
        for key in ("containers", "initContainers"):
            for c in node.get(key) or []:
                if isinstance(c, dict) and isinstance(c.get("image"), str):
                    name, tag, digest = _split_image(c["image"])
                    for r in rules:
                        if r["name"] == name:
                            name = r.get("newName", name)
                            if "digest" in r:
                                tag, digest = "", r["digest"]
                            elif "newTag" in r:
                                tag, digest = str(r["newTag"]), ""
                            c["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
                            break
        for v in node.values():
            _images(v, rules)
    elif isinstance(node, list):
        for v in node:
            _images(v, rules)


def render(folder):
    """The objects `kubectl kustomize folder` prints, for the supported subset (module doc)."""
    path = _kustomization_file(folder)
    k = yaml.safe_load(open(path)) or {}
    unknown = set(k) - _FIELDS
    if unknown:
        raise KustomizeError(f"{path}: field(s) {sorted(unknown)} are not supported by scripts/kustomize.py")
    objs = []
    for r in k.get("resources") or []:
        p = os.path.join(folder, r)
        if os.path.isdir(p):
            objs += render(p)
        elif os.path.isfile(p):
            objs += _load_yaml_docs(p)
        else:
            raise KustomizeError(f"{path}: resource {r!r} does not exist")
    seen = set()
    for o in objs:
        if _res_id(o) in seen:
            raise KustomizeError(f"{path}: resource {_res_id(o)} appears twice")
        seen.add(_res_id(o))
    _apply_patches(objs, k.get("patches") or [], folder, path)
    for i, r in enumerate(k.get("replicas") or []):
        hits = [o for o in objs if o.get("kind") in ("Deployment", "StatefulSet", "ReplicaSet")
                and o["metadata"].get("name") == r.get("name")]
        if not hits or not isinstance(r.get("count"), int):
            raise KustomizeError(f"{path}: replicas[{i}]: needs the name of a workload and an integer count")
        for o in hits:
            o.setdefault("spec", {})["replicas"] = r["count"]
    for i, r in enumerate(k.get("images") or []):
        if "name" not in r or set(r) - {"name", "newName", "newTag", "digest"}:
            raise KustomizeError(f"{path}: images[{i}]: needs 'name' (and newName/newTag/digest only)")
    _images(objs, k.get("images") or [])
    return objs


def _sort_key(obj):
    kind = obj.get("kind")
    if kind in _KIND_ORDER:
        rank = _KIND_ORDER.index(kind)
    elif kind in _KIND_LAST:
        rank = len(_KIND_ORDER) + 1 + _KIND_LAST.index(kind)
    else:
        rank = len(_KIND_ORDER)
    return (rank, kind or "", (obj.get("metadata") or {}).get("name") or "")


def main(argv):
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    try:
        objs = render(argv[1])
    except (KustomizeError, OSError, yaml.YAMLError) as e:
        print(f"kustomize.py: {e}", file=sys.stderr)
        return 1
    yaml.safe_dump_all(sorted(objs, key=_sort_key), sys.stdout, sort_keys=True, default_flow_style=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
