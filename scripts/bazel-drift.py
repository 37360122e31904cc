#!/usr/bin/env python3
"""Keeps the Bazel build in step with CMake (docs/build.md, "Keeping them in step").

Fails, naming what is missing, unless
  - every .cc that CMake compiles in a checked folder (libraries, binaries, test binaries of
    odyssey_test()/odyssey_test_exe()) is a source of some Bazel target;
  - every .cc/.h/.proto on disk in those folders is a source of some Bazel target (so a new file
    belongs to a target in both builds, not only in one);
  - every CMake test there (add_test, odyssey_test) is a Bazel test of the same name in the
    same package, and the other way round;
  - every GPU-only test (CMake's odyssey_gpu_test(binary name filter)) is left out of Bazel, as
    CMake leaves its cases out of the binary's own entry: the Bazel cc_test `binary` has
    env GTEST_FILTER that excludes `filter` (the Bazel build is CPU-only: no CUDA, so those
    cases could only skip);
  - common/BUILD's ODYSSEY_VERSION is the top-level CMakeLists.txt's project(VERSION).
The checked folders: every component folder with a CMakeLists.txt, the libtorch ones (kernels/,
model/, engine/, worker/, tools/, bench/) included. Not checked: tests/ (its tests are driven by
Python, ctest only) and kernels/cuda/*.cu (CUDA, compiled by CMake with ODYSSEY_CUDA only).

This checks what both builds *name*; scripts/bazel-test.sh --all builds and runs all of it.

Usage: scripts/bazel-drift.py [--bazel bazel]   (run from anywhere; queries the workspace)
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The folders checked, all of their CMake targets.
FOLDERS = ("common", "planner", "proto", "server", "client", "kernels", "model", "engine",
           "worker", "tools", "bench")


def cmake_commands(text):
    """Yields (command, [args]) in order; comments dropped, quotes kept out of tokens."""
    text = re.sub(r"#[^\n]*", "", text)
    for m in re.finditer(r"(\w+)\s*\(((?:[^()]|\([^()]*\))*)\)", text):
        yield m.group(1).lower(), re.findall(r'"[^"]*"|[^\s"]+', m.group(2))


def cmake_part(folder):
    """(sources, tests, gpu_tests) that folder/CMakeLists.txt builds, foreach loops expanded.

    gpu_tests: {test name: (binary, filter)} of odyssey_gpu_test(binary name filter).
    """
    sources, tests, gpu_tests = set(), set(), {}
    loops = []  # (variable, items)

    def expand(token):
        out = [token]
        for var, items in loops:
            ref = "${%s}" % var
            if any(ref in o for o in out):
                out = [o.replace(ref, i) for o in out for i in items]
        return out

    def add_sources(tokens):
        for a in tokens:
            for src in expand(a):
                if src.endswith(".cc") and "${" not in src:
                    sources.add(f"{folder}/{src}")

    with open(os.path.join(ROOT, folder, "CMakeLists.txt")) as f:
        text = f.read()
    for cmd, args in cmake_commands(text):
        if cmd == "foreach":
            loops.append((args[0], args[1:]))
        elif cmd == "endforeach":
            loops.pop()
        elif cmd in ("add_library", "add_executable") and args and "INTERFACE" not in args:
            add_sources(args[1:])
        elif cmd in ("odyssey_test", "odyssey_test_exe") and len(args) >= 2:
            add_sources(args[1:2])
            if cmd == "odyssey_test":
                tests.update(f"//{folder}:{n}" for n in expand(args[0]))
        elif cmd == "odyssey_gpu_test" and len(args) == 3:
            gpu_tests[f"//{folder}:{args[1]}"] = (f"//{folder}:{args[0]}", args[2].strip('"'))
        elif cmd == "add_test" and len(args) >= 2 and args[0] == "NAME":
            tests.update(f"//{folder}:{n}" for n in expand(args[1]))
    return sources, tests, gpu_tests


def disk_files(folder):
    out = set()
    base = os.path.join(ROOT, folder)
    for dirpath, _, names in os.walk(base):
        for n in names:
            rel = os.path.relpath(os.path.join(dirpath, n), ROOT)
            if n.endswith((".cc", ".h", ".proto")) and "/python/" not in rel:
                out.add(rel)
    return out


def gtest_filter_excludes(env_filter, pattern):
    """Whether a GTEST_FILTER value of negative patterns only ("-A.*:B.*") names every pattern of
    `pattern` (itself one or several joined by ':')."""
    excluded = env_filter[1:].split(":") if env_filter.startswith("-") else []
    return all(p in excluded for p in pattern.split(":"))


def bazel_query(bazel, expr, output=None):
    cmd = [bazel, "query", "--noshow_progress", expr]
    if output:
        cmd.insert(3, f"--output={output}")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"bazel-drift: bazel query {expr!r} failed:\n{r.stderr}")
    return r.stdout if output else set(r.stdout.split())


def bazel_test_env(bazel, labels):
    """{label: {var: value}} of the env attribute of the given Bazel tests (one query)."""
    out = {}
    text = bazel_query(bazel, " + ".join(sorted(labels)), output="build")
    for rule in re.split(r"\n(?=# )", text):
        m = re.search(r'name = "([^"]+)"', rule)
        loc = re.search(r"^# (\S+)/BUILD", rule, re.M)
        if not m or not loc:
            continue
        pkg = os.path.relpath(loc.group(1), ROOT)
        env = re.search(r"env = \{([^}]*)\}", rule)
        out[f"//{pkg}:{m.group(1)}"] = dict(re.findall(r'"([^"]+)": "([^"]*)"', env.group(1))) if env else {}
    return out


def label_to_path(label):
    pkg, name = label[2:].split(":")
    return f"{pkg}/{name}" if pkg else name


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bazel", default="bazel")
    args = ap.parse_args()

    pkgs = " + ".join(f"//{f}/..." for f in FOLDERS)
    # The files the folders' own rules name, not deps(): that would load @torch (the venv's
    # Python importing torch, some 9,000 headers), a minute of CI's time for nothing checked here.
    named = " + ".join(f"labels({a}, {pkgs})" for a in ("srcs", "hdrs", "textual_hdrs"))
    bazel_srcs = {label_to_path(l) for l in bazel_query(
        args.bazel, f'kind("source file", {named})') if l.startswith("//")}
    bazel_tests = bazel_query(args.bazel, f"tests({pkgs})")

    missing = []
    cmake_tests = set()
    gpu_tests = {}
    for folder in FOLDERS:
        srcs, tests, gpu = cmake_part(folder)
        cmake_tests |= tests
        gpu_tests.update(gpu)
        for s in sorted(srcs - bazel_srcs):
            missing.append(f"{s}: compiled by {folder}/CMakeLists.txt, in no Bazel target ({folder}/BUILD)")
        for s in sorted(disk_files(folder) - bazel_srcs):
            missing.append(f"{s}: on disk, in no Bazel target ({folder}/BUILD)")
    for t in sorted(cmake_tests - bazel_tests):
        missing.append(f"{t}: a CMake test with no Bazel test of that name")
    for t in sorted(bazel_tests - cmake_tests):
        missing.append(f"{t}: a Bazel test with no CMake test of that name")
    binaries = {b for b, _ in gpu_tests.values() if b in bazel_tests}
    envs = bazel_test_env(args.bazel, binaries) if binaries else {}
    for t, (binary, pattern) in sorted(gpu_tests.items()):
        if t in bazel_tests:
            missing.append(f"{t}: a GPU-only CMake test (odyssey_gpu_test), which the CPU-only Bazel build leaves out")
        elif binary in envs and not gtest_filter_excludes(envs[binary].get("GTEST_FILTER", ""), pattern):
            missing.append(f"{binary}: its env GTEST_FILTER does not exclude {pattern} (CMake's GPU-only "
                           f"test {t}), as CMake's entry for the binary does")
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
    print(f"bazel-drift: ok ({len(bazel_srcs)} Bazel source files, {len(cmake_tests)} tests in both builds, "
          f"{len(gpu_tests)} GPU-only CMake tests left out of Bazel)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
