"""Side environments for the test suite's judges: the SGLang conformance venv and the TRL venv.

    python scripts/side_venv.py --venv DIR --stamp NAME [--check CODE] [--check-path DIR ...]
        [--project-deps] [--no-deps PKG ...] -- REQUIREMENT ...

A side venv is the calling environment plus a few packages of its own. It is made without
`--system-site-packages` (inside a venv that flag means the *base* interpreter's packages, not the venv's) and
sees the calling interpreter's own site directories through a `.pth` file placed after its own site-packages:
`site.addsitedir` on each, so the caller's `.pth` files (an editable miles install) work there too. So the side
venv runs the caller's torch, transformers and miles dependencies, whether the caller is a venv or the system
Python, and a package the caller gains later is seen there too. Only what the side venv adds is installed, with
every package the caller has pinned as a constraint to the caller's version (pip never replaces the caller's
torch by a CUDA build or its transformers by another release); a torch the caller lacks is pinned to the CPU
build `torch==2.13.0` on a machine without an NVIDIA GPU, as `scripts/install.sh` does.

`REQUIREMENT`s are installed with their dependencies, `--no-deps` packages without; `--project-deps` adds
miles' own runtime dependencies (pyproject.toml), which the children import through miles (normally all
satisfied by the caller). The venv is ready when `--check` runs without error in it (with `--check-path` on
PYTHONPATH); then the stamp file `--stamp` is written. A stamp that matches the requested packages, the
caller's interpreter, site directories and the caller's versions of the requested packages makes a second
call return at once; otherwise the venv is made again from scratch. A failure leaves no stamp and the reason in
`DIR/setup-error.log`; the exit status is then 1.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import site
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CPU_TORCH = "2.13.0"  # the CPU build scripts/install.sh installs on a machine without an NVIDIA GPU
ERROR_LOG = "setup-error.log"
PTH_NAME = "_miles_calling_env.pth"


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    """The canonical distribution name of a requirement string ("sglang==0.5.23", "ray[default]>=2.40")."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not m:
        raise ValueError(f"not a requirement: {req!r}")
    return canonical(m.group(1))


def _pins_version(req: str) -> bool:
    return bool(re.search(r"[=<>!~@]", req.split(";")[0]))


def calling_site_dirs() -> list[str]:
    """The calling interpreter's site directories (its venv's, or the system's), not PYTHONPATH: existing
    directories in the order the interpreter searches them."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    seen: list[str] = []
    for d in dirs:
        if os.path.isdir(d) and d not in seen:
            seen.append(d)
    return seen


def installed_versions(dirs: Sequence[str]) -> dict[str, str]:
    """{canonical name: version} of the distributions in `dirs`; the first one found wins, as on import."""
    out: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=list(dirs)):
        name = dist.metadata["Name"]
        if name and dist.version:
            out.setdefault(canonical(name), dist.version)
    return out


VERSION = re.compile(
    r"v?\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?(\+[a-z0-9]+(\.[a-z0-9]+)*)?"
)  # PEP 440, normalised


def _valid_version(v: str) -> bool:
    return VERSION.fullmatch(v) is not None


def constraints_text(installed: dict[str, str], explicit: Iterable[str], cpu_torch: str | None) -> str:
    """pip constraints: every caller package at the caller's version, except those `explicit` requirements pin
    themselves; a torch the caller lacks at `cpu_torch` (None: no pin, a machine with an NVIDIA GPU)."""
    own = {requirement_name(r) for r in explicit if _pins_version(r)}
    lines = [f"{n}=={v}" for n, v in sorted(installed.items()) if n not in own and _valid_version(v)]
    if "torch" not in installed and "torch" not in own and cpu_torch:
        lines.append(f"torch=={cpu_torch}")
    return "".join(line + "\n" for line in lines)


def pth_text(dirs: Sequence[str]) -> str:
    """The `.pth` line that adds the caller's site directories (processing their own `.pth` files)."""
    return "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n"


def has_nvidia_gpu() -> bool:
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def project_dependencies(pyproject: Path = REPO / "pyproject.toml") -> list[str]:
    """miles' runtime dependencies, `[project] dependencies` of pyproject.toml."""
    text = pyproject.read_text()
    m = re.search(r"^\[project\].*?^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M)
    if not m:
        raise ValueError(f"no [project] dependencies in {pyproject}")
    return re.findall(r'"([^"]+)"', m.group(1))


def stamp_key(
    requirements: Sequence[str],
    no_deps: Sequence[str],
    check: str,
    dirs: Sequence[str],
    installed: dict[str, str],
) -> str:
    """What the venv was made from: a change in any of it makes the venv again."""
    names = sorted({requirement_name(r) for r in [*requirements, *no_deps]} | {"torch", "transformers"})
    key = {
        "python": sys.version,
        "executable": sys.executable,
        "dirs": list(dirs),
        "requirements": list(requirements),
        "no_deps": list(no_deps),
        "check": check,
        "caller_versions": {n: installed.get(n) for n in names},
    }
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()


def is_ready(venv: Path, stamp: str) -> bool:
    return (venv / stamp).is_file() and (venv / "bin" / "python").is_file()


def missing_reason(venv: Path, stamp: str, make: str) -> str | None:
    """None when `venv` is ready; else why not, with the last line of its setup log and the command that makes it."""
    if is_ready(venv, stamp):
        return None
    reason = f"{venv} is not ready (make it with: {make})"
    log = venv / ERROR_LOG
    if log.is_file():
        last = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
        reason += f"; {log}: {last[0] if last else '(empty)'}"
    return reason


def _site_packages(venv: Path) -> Path:
    py = venv / "bin" / "python"
    out = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return Path(out.stdout.strip())


def make(
    venv: Path,
    stamp: str,
    requirements: Sequence[str],
    no_deps: Sequence[str] = (),
    check: str = "",
    check_path: Sequence[str] = (),
    log: Callable[[str], object] = print,
) -> bool:
    """Make `venv` (see the module docstring) unless its stamp says it is there. True when ready."""
    venv = venv.absolute()
    dirs = [d for d in calling_site_dirs() if not Path(d).is_relative_to(venv)]
    installed = installed_versions(dirs)
    want = stamp_key(requirements, no_deps, check, dirs, installed)
    if is_ready(venv, stamp) and (venv / stamp).read_text().strip() == want:
        return True
    log(f"making {venv} over {sys.executable}'s packages (first use; takes a minute or more)")
    shutil.rmtree(venv, ignore_errors=True)
    venv.mkdir(parents=True)
    errors = venv / ERROR_LOG

    def fail(what: str, out: str) -> bool:
        errors.write_text(out + ("" if out.endswith("\n") else "\n") + what + "\n")
        log(f"{what} (see {errors})")
        return False

    no_pip = [] if requirements or no_deps else ["--without-pip"]  # nothing to install: pip takes a while
    made = subprocess.run([sys.executable, "-m", "venv", *no_pip, str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        return fail("cannot make a venv", made.stdout + made.stderr)
    (_site_packages(venv) / PTH_NAME).write_text(pth_text(dirs))
    constraints = venv / "constraints.txt"
    cpu_torch = None if has_nvidia_gpu() else CPU_TORCH
    constraints.write_text(constraints_text(installed, [*requirements, *no_deps], cpu_torch))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(constraints)]
    for extra, pkgs in (([], requirements), (["--no-deps"], no_deps)):
        if pkgs:
            done = subprocess.run([*pip, *extra, *pkgs], capture_output=True, text=True)
            if done.returncode != 0:
                return fail(f"pip could not install {' '.join(pkgs)}", done.stdout + done.stderr)
    if check:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(check_path))
        py = str(venv / "bin" / "python")
        done = subprocess.run([py, "-W", "ignore", "-c", check], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            return fail(f"the check does not run in {venv}: {last}", done.stdout + done.stderr)
    (venv / stamp).write_text(want + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", required=True, type=Path)
    p.add_argument("--stamp", required=True, help="file name written in the venv once it is ready")
    p.add_argument("--check", default="", help="Python code that must run in the venv")
    p.add_argument("--check-path", nargs="*", default=[], help="PYTHONPATH entries for --check")
    p.add_argument("--project-deps", action="store_true", help="also miles' runtime dependencies")
    p.add_argument("--no-deps", nargs="*", default=[], help="packages installed without their dependencies")
    p.add_argument("--label", default="side-venv", help="prefix of the messages")
    p.add_argument("requirements", nargs="*")
    a = p.parse_args(argv)
    reqs = [*a.requirements, *(project_dependencies() if a.project_deps else [])]

    def log(msg: str) -> None:
        print(f"[{a.label}] {msg}", flush=True)

    return 0 if make(a.venv, a.stamp, reqs, a.no_deps, a.check, a.check_path, log) else 1


if __name__ == "__main__":
    sys.exit(main())
