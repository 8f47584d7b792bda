"""Install the wheels carried to an offline machine (the lent GPU has no package registry).

``python -m perf.install_wheels [--wheels .whl] --target DIR [--dry-run]``, then
``export PYTHONPATH=DIR``: ``pip install --no-index --no-deps --target DIR`` of

- every carried wheel whose distribution is not installed (nvshmem4py-cu13: the image has none),
- and a carried wheel of an installed distribution only where a chosen wheel needs a newer
  one than the machine has (nvshmem4py 0.4.1 needs ``cuda.core >= 0.5.0`` and
  ``cuda.pathfinder >= 1.2.3``; the image ships both packages, of versions only a run there
  shows), so that a carried copy never shadows a good installed one.

It prints each decision and each requirement of the chosen wheels that the machine does not
meet and no carried wheel does (e.g. the ``cuda-python`` metapackage, whose ``cuda.bindings``
the image has). Exit status 0 also when nothing is carried (the NVSHMEM steps then skip); 1
when pip fails. Which wheels to carry and how to download them: docs/gpu-check.md.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata as md
import os
import subprocess
import sys
import zipfile

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def wheel_metadata(path: str) -> tuple[str, Version, list[Requirement]]:
    """``(name, version, requirements)`` of a wheel, from its ``*.dist-info/METADATA``;
    requirements whose marker does not hold here (extras, other Pythons) are left out."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    fields = [line.split(": ", 1) for line in text.splitlines() if ": " in line]
    name = next(v for k, v in fields if k == "Name")
    version = Version(next(v for k, v in fields if k == "Version"))
    reqs = [Requirement(v) for k, v in fields if k == "Requires-Dist"]
    reqs = [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]
    return canonicalize_name(name), version, reqs


def installed_version(name: str) -> Version | None:
    try:
        return Version(md.version(name))
    except md.PackageNotFoundError:
        return None


def choose(wheels: dict[str, tuple[str, Version, list[Requirement]]], installed) -> tuple:
    """The wheels to install and the unmet requirements: ``(chosen names, notes)``.

    ``wheels``: ``{name: (path, version, requirements)}``; ``installed(name)`` the machine's
    version or None."""
    chosen = [n for n in wheels if installed(n) is None]
    notes, seen = [], set()
    i = 0
    while i < len(chosen):
        for req in wheels[chosen[i]][2]:
            dep = canonicalize_name(req.name)
            if dep in seen:
                continue
            seen.add(dep)
            have = installed(dep)
            if have is not None and req.specifier.contains(have, prereleases=True):
                notes.append(f"{req}: installed {have}, kept")
            elif dep in wheels and req.specifier.contains(wheels[dep][1], prereleases=True):
                notes.append(f"{req}: installed {have or 'none'}, the carried {wheels[dep][1]}")
                if dep not in chosen:
                    chosen.append(dep)
            else:
                notes.append(f"{req}: installed {have or 'none'}, not carried (UNMET)")
        i += 1
    return chosen, notes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", default=".whl", help="folder of carried wheels")
    ap.add_argument("--target", required=True, help="install folder (put it on PYTHONPATH)")
    ap.add_argument("--dry-run", action="store_true", help="decide and print, install nothing")
    args = ap.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.wheels, "*.whl")))
    if not paths:
        print(f"install_wheels: no wheels in {args.wheels}: nothing carried, nothing installed")
        return 0
    wheels = {}
    for p in paths:
        name, version, reqs = wheel_metadata(p)
        if name in wheels:
            raise ValueError(f"--wheels: two wheels of {name} ({wheels[name][0]}, {p}): keep one")
        wheels[name] = (p, version, reqs)
    chosen, notes = choose(wheels, installed_version)
    for name, (_, version, _) in wheels.items():
        what = "install" if name in chosen else f"skip (installed {installed_version(name)})"
        print(f"install_wheels: {name} {version}: {what}")
    for note in notes:
        print(f"install_wheels:   needs {note}")
    if args.dry_run or not chosen:
        return 0
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", args.target,
           *(wheels[n][0] for n in chosen)]  # fmt: skip
    r = subprocess.run(cmd)
    print(f"install_wheels: pip exit {r.returncode}; export PYTHONPATH={args.target}")
    if r.returncode != 0:
        return 1
    return 0 if imported_from_target(chosen, args.target) else 1


MODULES = {"nvshmem4py-cu13": "nvshmem.core", "cuda-core": "cuda.core",
           "cuda-pathfinder": "cuda.pathfinder"}  # fmt: skip
"""The module each carried distribution provides (what the NVSHMEM steps import)."""


def imported_from_target(chosen: list[str], target: str) -> bool:
    """Import each chosen distribution's module in a fresh interpreter with ``target`` first on
    ``PYTHONPATH`` and print where it came from; False when one comes from elsewhere (an image
    whose ``cuda/`` is a regular package shadows the carried namespace part)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (target, os.environ.get("PYTHONPATH")) if p))  # fmt: skip
    ok = True
    for name in chosen:
        module = MODULES.get(name)
        if module is None:
            continue
        code = f"import importlib; print(importlib.import_module({module!r}).__file__)"
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        if r.returncode == 0:
            where = r.stdout.strip()
            carried = os.path.realpath(where).startswith(os.path.realpath(target))
        else:
            where, carried = (r.stderr.strip().splitlines() or ["?"])[-1], False
        what = "carried" if carried else "NOT the carried copy"
        print(f"install_wheels: {name}: import {module} -> {where} ({what})")
        ok &= carried
    return ok


if __name__ == "__main__":
    raise SystemExit(main())
