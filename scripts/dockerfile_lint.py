#!/usr/bin/env python3
"""Checks Dockerfiles for the rules odyssey's images keep (deploy/docker/), where no image can be
built (CI reaches no container registry, so no base image can be pulled):

  pinned-base      every FROM names an earlier stage, or an image with an explicit tag that is
                   not `latest` (or a digest); no variables in the image (an ARG default is not
                   a pin anyone reviews)
  multi-stage      at least two stages, and COPY --from names an earlier stage
  non-root         the final stage's last USER is set and is neither root nor uid 0
  healthcheck      the final stage has a HEALTHCHECK with a command (not NONE)
  no-add-url       no ADD of a URL or git repository (fetch in a build stage, checked, instead)
  apt-hygiene      apt-get install with -y and --no-install-recommends, and the lists removed
                   in the same RUN

    python3 scripts/dockerfile_lint.py deploy/docker/*.Dockerfile

Prints one line per finding, `file:line: rule: what`, and exits 1 if there is any. Also
importable: lint(text, name) returns the findings.
"""
import re
import sys


def instructions(text):
    """(line number, INSTRUCTION, arguments) for each instruction: comments and blank lines
    dropped, backslash continuations joined (the line number is the first line's)."""
    out = []
    pending, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if not pending:
            start = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        pending += line
        word, _, rest = pending.partition(" ")
        out.append((start, word.upper(), rest.strip()))
        pending = ""
    if pending:
        word, _, rest = pending.partition(" ")
        out.append((start, word.upper(), rest.strip()))
    return out


def _pinned(image):
    if "@sha256:" in image:
        return True
    name = image.rsplit("/", 1)[-1]
    return ":" in name and name.rsplit(":", 1)[1] not in ("", "latest")


def lint(text, name="Dockerfile"):
    """The findings for one Dockerfile's text, as 'name:line: rule: what' strings."""
    found = []

    def report(line, rule, what):
        found.append(f"{name}:{line}: {rule}: {what}")

    stages = []  # (stage name or None, FROM line, [(line, instr, args)])
    for line, instr, args in instructions(text):
        if instr == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            image = words[0] if words else ""
            alias = words[2].lower() if len(words) >= 3 and words[1].upper() == "AS" else None
            known = {s[0] for s in stages if s[0]}
            if "$" in image:
                report(line, "pinned-base", f"FROM {image}: a variable in the base image is no pin")
            elif image.lower() not in known and image != "scratch" and not _pinned(image):
                report(line, "pinned-base", f"FROM {image}: give an explicit tag other than latest, or a digest")
            stages.append((alias, line, []))
            continue
        if not stages:
            if instr != "ARG":
                report(line, "pinned-base", f"{instr} before the first FROM")
            continue
        stages[-1][2].append((line, instr, args))
        if instr == "ADD" and re.search(r"(^|\s)(https?://|git@|ftp://)", args):
            report(line, "no-add-url", "ADD of a URL: download in a build stage and check what came")
        if instr == "COPY":
            m = re.search(r"--from=(\S+)", args)
            if m:
                src = m.group(1).lower()
                earlier = {s[0] for s in stages[:-1] if s[0]}
                if src not in earlier and not (src.isdigit() and int(src) < len(stages) - 1):
                    report(line, "multi-stage", f"COPY --from={m.group(1)}: not an earlier stage of this file")
        if instr == "RUN" and re.search(r"apt-get\s+(-\S+\s+)*install", args):
            if not re.search(r"(^|\s)(-[a-zA-Z]*y[a-zA-Z]*|--yes|--assume-yes)(\s|$)", args):
                report(line, "apt-hygiene", "apt-get install without -y")
            if "--no-install-recommends" not in args:
                report(line, "apt-hygiene", "apt-get install without --no-install-recommends")
            if "rm -rf /var/lib/apt/lists" not in args:
                report(line, "apt-hygiene", "the apt lists are not removed in the same RUN")
    if not stages:
        report(1, "multi-stage", "no FROM")
        return found
    if len(stages) < 2:
        report(stages[0][1], "multi-stage", "one stage: build or unpack in a stage of its own")
    final = stages[-1]
    users = [(line, args) for line, instr, args in final[2] if instr == "USER"]
    if not users:
        report(final[1], "non-root", "the final stage sets no USER (it would run as root)")
    else:
        line, user = users[-1]
        if user.split(":")[0] in ("root", "0"):
            report(line, "non-root", f"USER {user}: the image runs as root")
    checks = [(line, args) for line, instr, args in final[2] if instr == "HEALTHCHECK"]
    if not checks:
        report(final[1], "healthcheck", "the final stage has no HEALTHCHECK")
    elif checks[-1][1].upper().startswith("NONE") or "CMD" not in checks[-1][1].upper().split():
        report(checks[-1][0], "healthcheck", "HEALTHCHECK without a command")
    return found


def main(paths):
    if not paths:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    findings = []
    for p in paths:
        with open(p) as f:
            findings += lint(f.read(), p)
    for f in findings:
        print(f)
    print(f"dockerfile_lint: {len(paths)} file(s), {len(findings)} finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
