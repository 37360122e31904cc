#!/usr/bin/env python3
"""The relocatable package, unpacked into a clean folder and run from there (ctest `package`):

1. `cpack` writes the `odyssey` tarball (bin/, share/: everything but libtorch), which is
   unpacked into a fresh temporary folder. The `torch` component (lib/odyssey: libtorch's
   libraries) is installed beside it with `cmake --install --component torch`: the same files
   as the `torch` tarball, without gzip-compressing ~460 MB on every CI run (--torch-tarball
   builds and unpacks that tarball instead).
2. Every ELF file's RPATH/RUNPATH is relative to the file ($ORIGIN...), and what the dynamic
   loader resolves (ldd, with an empty environment) lies in the unpacked tree or the system's
   library folders, never in the build tree or the venv.
3. The controller, the CLI and odyssey-plan run from the `odyssey` tarball alone (before
   lib/odyssey exists, and they name no libtorch), while the worker then cannot start: it does not
   find a libtorch elsewhere. After the torch component it runs.
4. Every Debian package whose libraries the binaries load is installed by the apt-get line of
   the image that carries them (deploy/docker/controller.Dockerfile for the torch-free binaries,
   worker.Dockerfile for all), itself or as a dependency apt pulls in (apt-cache depends), or is
   one of the few libraries every debian:12-slim image has.
5. End to end from the unpacked tree, with an empty environment (PATH: the tree's bin/ and the
   system's) in a folder of its own: the controller, a CPU worker and the tiny SFT job submitted
   and followed with the package's CLI; it SUCCEEDS, the loss falls well below chance and the
   checkpoint is written. Every shared object the running worker has mapped comes from the tree
   or the system (/proc/PID/maps), libtorch from the tree's lib/odyssey; the controller maps no
   libtorch.
6. The Python client's tree in share/odyssey/python finds its proto inside the package.

    python3 tests/package/package_test.py --build-dir build --source-dir .
    python3 tests/package/package_test.py --build-dir build --source-dir . --tree /opt/odyssey
        (steps 2-6 on a tree installed elsewhere: a GPU host's, or one copied out of an image)
"""
import argparse
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "service"))
from harness import Failure, Processes, free_port_base, wait_for_port_file  # noqa: E402

TORCH_FREE = ("odyssey-controller", "odyssey", "odyssey-plan")
TORCH = ("odyssey-worker", "odyssey-train", "odyssey-bench")
SYSTEM_DIRS = ("/lib/", "/lib64/", "/usr/lib/", "/usr/lib64/")
# Libraries every debian:12-slim image has (apt, dpkg and coreutils need them), so an image's
# apt-get line need not name them even where no package it names depends on them.
BASE_IMAGE = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g", "libzstd1", "liblzma5", "libsystemd0", "libgcrypt20",
              "libgpg-error0", "liblz4-1", "libcap2", "libselinux1", "libpcre2-8-0", "libbz2-1.0", "libcrypt1",
              "libudev1", "libxxhash0", "libgmp10", "libacl1", "libattr1"}


def run(argv, what, timeout=300, **kw):
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if out.returncode != 0:
        raise Failure(f"{what} failed ({out.returncode}): {out.stdout[-2000:]}{out.stderr[-2000:]}")
    return out.stdout


def clean_env(root, home):
    return {"PATH": f"{root}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8",
            "OMP_WAIT_POLICY": "PASSIVE"}


def elf_files(root):
    for d in ("bin", "lib/odyssey"):
        for p in sorted(glob.glob(os.path.join(root, d, "*"))):
            with open(p, "rb") as f:
                if f.read(4) == b"\x7fELF":
                    yield p


def ldd(path, env):
    """{soname: resolved path or None (not found)} as the loader resolves them for `path`."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True, env=env, timeout=60).stdout
    libs = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) => (not found|(\S+) \(0x)", line)
        if m:
            libs[m.group(1)] = None if m.group(2) == "not found" else os.path.realpath(m.group(3))
    return libs


def inside(path, root):
    return os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)


def check_elves(root, env, forbidden):
    n = 0
    for p in elf_files(root):
        dyn = run(["readelf", "-d", p], f"readelf -d {p}")
        for m in re.finditer(r"\((RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", dyn):
            for entry in m.group(2).split(":"):
                if not entry.startswith("$ORIGIN"):
                    raise Failure(f"{p}: {m.group(1)} entry {entry!r} is not relative to the file ($ORIGIN)")
        for name, where in ldd(p, env).items():
            if where is None:
                continue  # checked per binary below
            if not (inside(where, root) or where.startswith(SYSTEM_DIRS)):
                raise Failure(f"{p}: {name} resolves to {where}, outside the package and the system")
            for f in forbidden:
                if where.startswith(f):
                    raise Failure(f"{p}: {name} resolves into {f}")
        n += 1
    return n


def dockerfile_packages(path, lint):
    """The packages the final stage's apt-get install lines name."""
    with open(path) as f:
        instrs = lint.instructions(f.read())
    last_from = max(i for i, (_, ins, _) in enumerate(instrs) if ins == "FROM")
    pkgs = set()
    for _, ins, args in instrs[last_from:]:
        for m in re.finditer(r"apt-get\s+install\s+(.*?)(&&|$)", args):
            pkgs |= {w for w in m.group(1).split() if not w.startswith("-")}
    return pkgs


def debian_packages(libs):
    """{package: [library, ...]}: the Debian packages owning the system libraries `libs` (paths)."""
    owners = {}
    for lib in libs:
        out = subprocess.run(["dpkg", "-S", lib], capture_output=True, text=True).stdout
        if not out:
            # dpkg knows /lib/x86_64-linux-gnu/... as /usr/lib/... or the other way round (usrmerge).
            alt = lib.replace("/usr/lib/", "/lib/", 1) if lib.startswith("/usr/lib/") else "/usr" + lib
            out = subprocess.run(["dpkg", "-S", alt], capture_output=True, text=True).stdout
        if not out:
            raise Failure(f"no Debian package owns {lib}")
        pkg = out.split(":")[0].split(",")[0].strip()
        owners.setdefault(pkg, []).append(os.path.basename(lib))
    return owners


def apt_closure(pkgs):
    """The packages apt installs for `pkgs`: them and their Depends/PreDepends, recursively."""
    out = subprocess.run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
                          "--no-breaks", "--no-replaces", "--no-enhances", *sorted(pkgs)],
                         capture_output=True, text=True, timeout=120).stdout
    closure = {line.strip() for line in out.splitlines() if line and not line.startswith((" ", "<"))}
    unknown = set(pkgs) - closure
    if unknown:
        raise Failure(f"apt-cache knows no package {sorted(unknown)} (no package lists? apt-get update)")
    return closure


def maps_of(pid):
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-1] for line in f if ".so" in line.split()[-1]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--torch-tarball", action="store_true", help="build and unpack the torch tarball too (slow)")
    ap.add_argument("--tree", help="check and run this install tree (e.g. an image's /opt/odyssey) instead of "
                    "packing the build's")
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    build = os.path.realpath(args.build_dir)
    src = os.path.realpath(args.source_dir)
    sys.path.insert(0, os.path.join(src, "scripts"))
    import dockerfile_lint

    tmp = tempfile.mkdtemp(prefix="odyssey-package-")
    t0 = time.monotonic()
    procs = Processes(tmp)
    ok = False
    try:
        venv = os.path.realpath(os.path.join(src, ".venv"))
        forbidden = [build + os.sep, venv + os.sep, src + os.sep]
        root = os.path.join(tmp, "unpacked", "odyssey")
        if args.tree:
            # An install tree made elsewhere (an image's /opt/odyssey, a GPU host's): its lib/ is
            # put back below, where the torch component would go.
            tree = os.path.realpath(args.tree)
            shutil.copytree(tree, root, symlinks=True,
                            ignore=lambda d, names: ["lib"] if os.path.realpath(d) == tree else [])
            print(f"ok: copied {tree} without lib/ in {time.monotonic() - t0:.1f}s")
        else:
            # 1. The tarball(s).
            comps = "odyssey;torch" if args.torch_tarball else "odyssey"
            run(["cpack", "-G", "TGZ", "-D", f"CPACK_COMPONENTS_ALL={comps}", "-B", os.path.join(tmp, "cpack")],
                "cpack", cwd=build)
            tarballs = sorted(glob.glob(os.path.join(tmp, "cpack", "odyssey-*.tar.gz")))
            names = [os.path.basename(t) for t in tarballs]
            want = ["-odyssey.tar.gz", "-torch.tar.gz"] if args.torch_tarball else ["-odyssey.tar.gz"]
            if len(tarballs) != len(want) or not all(n.endswith(w) for n, w in zip(names, want)):
                raise Failure(f"cpack wrote {names}, want one tarball per component {want}")
            odyssey_tgz = tarballs[0]
            size = os.path.getsize(odyssey_tgz)
            print(f"ok: cpack wrote {names[0]} ({size / 2**20:.1f} MiB) in {time.monotonic() - t0:.1f}s")
            os.makedirs(root)
            with tarfile.open(odyssey_tgz) as t:
                members = t.getnames()
                if any(m.startswith(("/", "..")) or "/../" in m for m in members):
                    raise Failure(f"{names[0]} has entries outside its folder")
                t.extractall(root)
        for b in TORCH_FREE + TORCH:
            if not os.access(os.path.join(root, "bin", b), os.X_OK):
                raise Failure(f"the package has no bin/{b}")
        for f in ("share/odyssey/proto/odyssey/v1/odyssey.proto", "share/odyssey/deploy/docker/worker.Dockerfile",
                  "share/odyssey/deploy/kubernetes/kustomization.yaml", "share/doc/odyssey/README.md",
                  "share/odyssey/python/pyproject.toml", "share/odyssey/python/proto/odyssey/v1/odyssey.proto"):
            if not os.path.isfile(os.path.join(root, f)):
                raise Failure(f"the package has no {f}")
        if os.path.exists(os.path.join(root, "lib")):
            raise Failure("the odyssey part carries lib/: libtorch belongs to the torch component")
        home = os.path.join(tmp, "home")
        os.makedirs(home)
        env = clean_env(root, home)

        # 3. The torch-free binaries run from this tarball alone; the worker does not start.
        for b in TORCH_FREE:
            libs = ldd(os.path.join(root, "bin", b), env)
            missing = [n for n, w in libs.items() if w is None]
            torchy = [n for n in libs if re.match(r"lib(torch|c10)", n)]
            if missing or torchy:
                raise Failure(f"bin/{b}: not found {missing}, libtorch {torchy}")
            out = run([os.path.join(root, "bin", b), "--version"], f"bin/{b} --version", env=env, cwd=home)
            print(f"ok: bin/{b} runs without lib/odyssey: {out.strip()}")
        libs = ldd(os.path.join(root, "bin", "odyssey-worker"), env)
        if libs.get("libtorch_cpu.so", "?") is not None:
            raise Failure(f"without lib/odyssey the worker still finds libtorch_cpu.so at {libs.get('libtorch_cpu.so')}")
        print("ok: without the torch component the worker finds no libtorch (no path to the build's)")

        # The torch component beside it.
        t1 = time.monotonic()
        if args.tree:
            shutil.copytree(os.path.join(tree, "lib"), os.path.join(root, "lib"), symlinks=True)
        elif args.torch_tarball:
            with tarfile.open(tarballs[1]) as t:
                t.extractall(root)
        else:
            run(["cmake", "--install", build, "--component", "torch", "--prefix", root], "cmake --install torch")
        torch_libs = sorted(os.listdir(os.path.join(root, "lib", "odyssey")))
        mib = sum(os.path.getsize(os.path.join(root, "lib", "odyssey", f)) for f in torch_libs) / 2**20
        print(f"ok: torch component: lib/odyssey holds {torch_libs} ({mib:.0f} MiB) in {time.monotonic() - t1:.1f}s")

        # 2. Relative rpaths, nothing resolved outside the tree and the system.
        n = check_elves(root, env, forbidden)
        for b in TORCH:
            libs = ldd(os.path.join(root, "bin", b), env)
            missing = [k for k, w in libs.items() if w is None]
            if missing:
                raise Failure(f"bin/{b}: {missing} not found")
            if not inside(libs["libtorch_cpu.so"], root):
                raise Failure(f"bin/{b}: libtorch_cpu.so from {libs['libtorch_cpu.so']}")
        print(f"ok: {n} ELF files: $ORIGIN-relative rpaths, every library from the tree or the system")

        # 4. The images install what the binaries load.
        docker = os.path.join(src, "deploy", "docker")
        for image, bins in (("controller.Dockerfile", TORCH_FREE), ("worker.Dockerfile", TORCH_FREE + TORCH)):
            system = {w for b in bins for w in ldd(os.path.join(root, "bin", b), env).values()
                      if w and not inside(w, root)}
            for lib in torch_libs if image == "worker.Dockerfile" else []:
                system |= {w for w in ldd(os.path.join(root, "lib", "odyssey", lib), env).values()
                           if w and not inside(w, root)}
            need = debian_packages(system)
            have = apt_closure(dockerfile_packages(os.path.join(docker, image), dockerfile_lint)) | BASE_IMAGE
            lacking = {p: v for p, v in need.items() if p not in have}
            if lacking:
                raise Failure(f"deploy/docker/{image}'s apt-get install (with what apt pulls in) lacks {lacking} "
                              "(package: the libraries the binaries load from it)")
            print(f"ok: deploy/docker/{image}: apt installs all {len(need)} Debian packages its binaries load")

        # 6. The Python client's tree finds its proto in the package.
        py = os.path.join(root, "share", "odyssey", "python")
        found = run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import _build_stubs; "
                     "print(_build_stubs.find_proto_root())", py], "the client's proto lookup",
                    env={"PATH": env["PATH"], "HOME": home})
        if not inside(found.strip(), root):
            raise Failure(f"share/odyssey/python finds its proto at {found.strip()}, outside the package")
        print("ok: share/odyssey/python (pip install it) builds from the package's own proto")

        # 5. End to end from the unpacked tree.
        work = os.path.join(tmp, "run")
        os.makedirs(work)
        port_file = os.path.join(work, "controller.port")
        controller = procs.spawn("controller", [
            os.path.join(root, "bin", "odyssey-controller"), "--listen", "127.0.0.1:0", "--port-file", port_file,
            "--state-dir", os.path.join(work, "state"), "--metrics-listen", "127.0.0.1:0",
            "--rendezvous-port-base", str(free_port_base())], env=env, cwd=work)
        address = f"127.0.0.1:{wait_for_port_file(port_file, 'the controller port file')}"
        mport = os.path.join(work, "w1.metrics-port")
        worker = procs.spawn("w1", [
            os.path.join(root, "bin", "odyssey-worker"), "--controller", address, "--worker-id", "w1", "--device", "cpu",
            "--threads", "1", "--metrics-listen", "127.0.0.1:0", "--metrics-port-file", mport,
            "--heartbeat-interval", "0.5", "--progress-interval", "0"], env=env, cwd=work)
        wait_for_port_file(mport, "the worker's metrics port")
        steps = 60
        spec = {"kind": "SFT", "displayName": "package", "model": {"name": "tiny", "dtype": "float32"},
                "optimizer": {"lr": 3e-3, "warmupSteps": 5, "gradClip": 1.0},
                "data": {"format": "kjv", "seqLen": 32, "batchSize": 4, "seed": 1},
                "steps": str(steps), "checkpoint": {"everySteps": str(steps), "keep": 1}}
        with open(os.path.join(work, "spec.json"), "w") as f:
            json.dump(spec, f)
        cli = [os.path.join(root, "bin", "odyssey"), "--controller", address]
        out = run(cli + ["submit", "spec.json", "--watch"], "odyssey submit --watch", env=env, cwd=work)
        name = re.search(r"jobs/\d+", out).group(0)
        procs.check_alive()
        mapped = maps_of(worker.pid)
        outside = sorted(m for m in mapped if not (inside(m, root) or m.startswith(SYSTEM_DIRS)))
        if outside:
            raise Failure(f"the worker maps {outside}, outside the package and the system")
        torch_maps = [m for m in mapped if "libtorch_cpu" in m]
        if not torch_maps or not all(inside(m, os.path.join(root, "lib", "odyssey")) for m in torch_maps):
            raise Failure(f"the worker's libtorch_cpu is {torch_maps}, not the package's")
        if any(re.search(r"lib(torch|c10)", os.path.basename(m)) for m in maps_of(controller.pid)):
            raise Failure("the controller maps libtorch")
        job = json.loads(run(cli + ["--json", "get", name], "odyssey get --json", env=env, cwd=work))
        if isinstance(job, list):
            job = job[0]
        state, step, loss = job.get("state"), int(job.get("step", 0)), float(job.get("loss", "nan"))
        ckpt = job.get("lastCheckpoint") or job.get("last_checkpoint") or ""
        print(f"ok: {name} from the unpacked tree: {state} at step {step}, loss {loss:.3f}, checkpoint {ckpt}")
        if state != "SUCCEEDED" or step != steps:
            raise Failure(f"{name}: {state} at step {step}, want SUCCEEDED at {steps}")
        if not loss < math.log(256) - 1.5:
            raise Failure(f"{name}: loss {loss} is not well below chance ({math.log(256):.3f})")
        if not (os.path.isfile(os.path.join(ckpt, "config.json")) and os.path.isfile(os.path.join(ckpt, "model.safetensors"))):
            raise Failure(f"{name}: no config.json + model.safetensors in {ckpt!r}")
        if any(ckpt.startswith(f) for f in forbidden):
            raise Failure(f"{name}: the checkpoint went into {ckpt}, inside the checkout")
        print(f"ok: the worker mapped {len(mapped)} shared objects, all from the package or the system; "
              "the controller no libtorch")
        ok = True
    except Failure as e:
        print(f"FAILED: {e}")
    finally:
        procs.stop()
        if not ok:
            procs.dump_logs()
        if args.keep:
            print(f"work folder kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"package: {'ok' if ok else 'FAILED'} in {time.monotonic() - t0:.1f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
