#!/usr/bin/env python3
"""Keeps the Bazel build in step with CMake for the torch-free part (docs/build.md).

Fails, naming what is missing, unless
  - every .cc that CMake compiles in a torch-free folder is a source of some Bazel target;
  - every .cc/.h/.proto on disk in those folders is a source of some Bazel target (so a new file
    belongs to a target in both builds, not only in one);
  - every CMake test there is a Bazel test of the same name in the same package, and the
    other way round;
  - common/BUILD's ODYSSEY_VERSION is the top-level CMakeLists.txt's project(VERSION).
The torch-free part: common/, planner/, proto/, server/, client/, and model/'s
odyssey_model_config (the rest of model/ needs libtorch, which the Bazel build does not link).

Usage: scripts/bazel-drift.py [--bazel bazel]   (run from anywhere; queries the workspace)
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# folder -> the CMake targets checked there (None: all of them).
FOLDERS = {
    "common": None,
    "planner": None,
    "proto": None,
    "server": None,
    "client": None,
    "model": {"odyssey_model_config"},
}
# Files on disk in FOLDERS that belong to torch targets (model/), so neither build's
# torch-free part names them.
DISK_ONLY = {"model": ("config.cc", "config.h")}


def cmake_commands(text):
    """Yields (command, [args]) in order; comments dropped, quotes kept out of tokens."""
    text = re.sub(r"#[^\n]*", "", text)
    for m in re.finditer(r"(\w+)\s*\(((?:[^()]|\([^()]*\))*)\)", text):
        yield m.group(1).lower(), re.findall(r'"[^"]*"|[^\s"]+', m.group(2))


def cmake_part(folder):
    """(sources, tests) that folder/CMakeLists.txt builds, foreach loops expanded."""
    wanted = FOLDERS[folder]
    sources, tests = set(), set()
    loops = []  # (variable, items)

    def expand(token):
        out = [token]
        for var, items in loops:
            ref = "${%s}" % var
            if any(ref in o for o in out):
                out = [o.replace(ref, i) for o in out for i in items]
        return out

    with open(os.path.join(ROOT, folder, "CMakeLists.txt")) as f:
        text = f.read()
    for cmd, args in cmake_commands(text):
        if cmd == "foreach":
            loops.append((args[0], args[1:]))
        elif cmd == "endforeach":
            loops.pop()
        elif cmd in ("add_library", "add_executable") and args and "INTERFACE" not in args:
            for name in expand(args[0]):
                if wanted is not None and name not in wanted:
                    continue
                for a in args[1:]:
                    for src in expand(a):
                        if src.endswith(".cc") and "${" not in src:
                            sources.add(f"{folder}/{src}")
        elif cmd == "add_test" and len(args) >= 2 and args[0] == "NAME":
            for name in expand(args[1]):
                if wanted is None or name in wanted:
                    tests.add(f"//{folder}:{name}")
    return sources, tests


def disk_files(folder):
    out = set()
    base = os.path.join(ROOT, folder)
    for dirpath, _, names in os.walk(base):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), ROOT)
            if n.endswith((".cc", ".h", ".proto")) and (folder not in DISK_ONLY or n in DISK_ONLY[folder]):
                if "/python/" not in rel:
                    out.add(rel)
    return out


def bazel_query(bazel, expr):
    r = subprocess.run([bazel, "query", "--noshow_progress", expr], cwd=ROOT,
                       capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"bazel-drift: bazel query {expr!r} failed:\n{r.stderr}")
    return set(r.stdout.split())


def label_to_path(label):
    pkg, name = label[2:].split(":")
    return f"{pkg}/{name}" if pkg else name


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bazel", default="bazel")
    args = ap.parse_args()

    pkgs = " + ".join(f"//{f}/..." for f in FOLDERS)
    bazel_srcs = {label_to_path(l) for l in bazel_query(
        args.bazel, f'kind("source file", deps({pkgs}))') if l.startswith("//")}
    bazel_tests = bazel_query(args.bazel, f"tests({pkgs})")

    missing = []
    cmake_tests = set()
    for folder in FOLDERS:
        srcs, tests = cmake_part(folder)
        cmake_tests |= tests
        for s in sorted(srcs - bazel_srcs):
            missing.append(f"{s}: compiled by {folder}/CMakeLists.txt, in no Bazel target ({folder}/BUILD)")
        for s in sorted(disk_files(folder) - bazel_srcs):
            missing.append(f"{s}: on disk, in no Bazel target ({folder}/BUILD)")
    for t in sorted(cmake_tests - bazel_tests):
        missing.append(f"{t}: a CMake test with no Bazel cc_test of that name")
    for t in sorted(bazel_tests - cmake_tests):
        missing.append(f"{t}: a Bazel test with no CMake test of that name")
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        cmake_version = re.search(r"project\(odyssey VERSION ([\w.]+)", f.read()).group(1)
    with open(os.path.join(ROOT, "common", "BUILD")) as f:
        m = re.search(r'ODYSSEY_VERSION=[\\"]*([\w.]+)', f.read())
    if not m or m.group(1) != cmake_version:
        missing.append(f"common/BUILD: ODYSSEY_VERSION {m.group(1) if m else '(none)'} is not "
                       f"CMakeLists.txt's project(VERSION {cmake_version})")
    if missing:
        print("bazel-drift: the Bazel and CMake builds differ (docs/build.md, \"Keeping them in step\"):")
        for m in missing:
            print("  " + m)
        return 1
    print(f"bazel-drift: ok ({len(bazel_srcs)} Bazel source files, {len(cmake_tests)} tests in both builds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
