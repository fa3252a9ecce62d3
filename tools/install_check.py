"""install.sh's questions to the target environment (stdlib only; run by the target interpreter, so
it sees exactly what that environment imports).

  missing PIN...         the pins not satisfied (absent or another version)
  conflicts PIN...       the pins installed at another version: "name have want location"
  shadowing NAME...      those of NAME that are importable: "name version location"
  planned REPORT         what a `pip install --dry-run --report` would replace: "name have -> new"
  requires NAME REPORT|- SKIP...
                         NAME's requirements (from the environment, else from a dry-run report)
                         but the extras-only ones and those named SKIP
  scripts NAME...        write the console scripts of NAME (torchrun, deepspeed, ...) that this venv
                         lacks because NAME lives in the base interpreter's site-packages
"""
import json
import re
import sys
from importlib import metadata


def _split(pin):
    name, want = pin.split("==")
    return name, want


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed(name):
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    return dist


def _matches(have, want):
    # a pin without a local label ("2.13.0") accepts any build of that release ("2.13.0+cpu")
    return have == want if "+" in want else have.split("+")[0] == want


def _location(dist):
    return str(dist.locate_file(""))


def missing(pins):
    for pin in pins:
        name, want = _split(pin)
        dist = _installed(name)
        if dist is None or not _matches(dist.version, want):
            print(pin)


def conflicts(pins):
    for pin in pins:
        name, want = _split(pin)
        dist = _installed(name)
        if dist is not None and not _matches(dist.version, want):
            print(name, dist.version, want, _location(dist))


def shadowing(names):
    for name in names:
        dist = _installed(name)
        if dist is not None:
            print(name, dist.version, _location(dist))


def planned(report_path):
    with open(report_path) as f:
        report = json.load(f)
    for item in report.get("install", []):
        name, new = item["metadata"]["name"], item["metadata"]["version"]
        dist = _installed(name)
        if dist is not None and dist.version != new:
            print(f"{_norm(name)} {dist.version} -> {new}")


def requires(name, report_path, *skip):
    dist = _installed(name)
    reqs = dist.requires if dist is not None else None
    if reqs is None and report_path != "-":
        with open(report_path) as f:
            items = json.load(f).get("install", [])
        reqs = next((i["metadata"].get("requires_dist", []) for i in items
                     if _norm(i["metadata"]["name"]) == _norm(name)), None)
    if reqs is None:
        sys.exit(f"install_check: no requirements found for {name}")
    skip = {_norm(s) for s in skip}
    for req in reqs:
        req_name = _norm(re.match(r"[A-Za-z0-9._-]+", req).group(0))
        if req_name not in skip and not re.search(r"\bextra\s*==", req):
            print(req)


SCRIPT = """#!{python}
import sys
from {module} import {attr}
sys.exit({call}())
"""


def scripts(names):
    """pip writes a package's commands only into the environment that installs it, so a venv that
    sees the base packages would otherwise run the base interpreter's torchrun (which cannot import
    this venv's arl)."""
    import os

    bindir = os.path.dirname(sys.executable)
    for name in names:
        dist = _installed(name)
        for ep in dist.entry_points if dist is not None else ():
            path = os.path.join(bindir, ep.name)
            if ep.group != "console_scripts" or os.path.exists(path):
                continue
            attr = ep.attr.split(".")[0]
            with open(path, "w") as f:
                f.write(SCRIPT.format(python=sys.executable, module=ep.module, attr=attr, call=ep.attr))
            os.chmod(path, 0o755)


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    {"missing": lambda: missing(args), "conflicts": lambda: conflicts(args),
     "shadowing": lambda: shadowing(args), "planned": lambda: planned(args[0]),
     "requires": lambda: requires(*args), "scripts": lambda: scripts(args)}[cmd]()
