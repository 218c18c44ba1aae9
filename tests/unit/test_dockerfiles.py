"""Static checks of Dockerfile and Dockerfile.cpu (no Docker engine runs in the test environment): every file
they copy and every script, module and extra they use exists in the repository, nothing they need is excluded by
.dockerignore, files are copied before a RUN uses them, a few hadolint-style rules hold, the GPU image builds on
lmsysorg/sglang with the `gpu` extra, and the CPU image runs the README's two commands."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Instruction:
    op: str
    args: str
    line: int


def parse(path: Path) -> list[Instruction]:
    """Instructions of a Dockerfile: comments dropped, backslash continuations joined."""
    out, buf, start = [], "", 0
    for n, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        op, _, args = buf.partition(" ")
        out.append(Instruction(op.upper(), args.strip(), start))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return out


def dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [s.strip() for s in lines if s.strip() and not s.startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    parts = rel.split("/")
    for pat in patterns:
        pat = pat.removeprefix("**/")
        for i in range(len(parts)):  # a pattern matching a directory excludes everything below it
            if fnmatch.fnmatch("/".join(parts[: i + 1]), pat) or fnmatch.fnmatch(parts[i], pat):
                return True
    return False


def run_words(ins: Instruction) -> list[str]:
    if ins.args.startswith("["):
        return json.loads(ins.args)
    return shlex.split(ins.args)


@pytest.fixture(params=["Dockerfile", "Dockerfile.cpu"])
def dockerfile(request) -> tuple[str, list[Instruction]]:
    return request.param, parse(REPO / request.param)


def test_copied_files_exist_and_are_in_the_build_context(dockerfile):
    name, instructions = dockerfile
    patterns = dockerignore()
    copies = [i for i in instructions if i.op in ("COPY", "ADD")]
    assert copies, name
    for ins in copies:
        assert ins.op == "COPY", f"{name}:{ins.line}: use COPY, not ADD"
        *sources, _dest = [w for w in shlex.split(ins.args) if not w.startswith("--")]
        for src in sources:
            assert (REPO / src).exists(), f"{name}:{ins.line}: {src} is not in the repository"
            assert not ignored(src, patterns), f"{name}:{ins.line}: {src} is excluded by .dockerignore"
            if (REPO / src).is_dir():
                files = [
                    p.relative_to(REPO).as_posix()
                    for p in (REPO / src).rglob("*")
                    if p.suffix in (".py", ".sh", ".md")
                ]
                assert files and not any(ignored(f, patterns) for f in files), src


def test_scripts_and_modules_used_exist_and_are_copied_first(dockerfile):
    name, instructions = dockerfile
    copied: list[str] = []
    for ins in instructions:
        if ins.op == "COPY":
            copied += [w for w in shlex.split(ins.args)[:-1] if not w.startswith("--")]
        if ins.op not in ("RUN", "CMD", "ENTRYPOINT"):
            continue
        text = " ".join(run_words(ins))
        for script in re.findall(r"(?:^|\s)((?:scripts|tests|examples)/[\w./-]+)", text):
            assert (REPO / script).exists(), f"{name}:{ins.line}: {script} does not exist"
            if ins.op == "RUN":  # CMD runs in the finished image; RUN needs it copied already
                assert any(script == c or script.startswith(c.rstrip("/") + "/") for c in copied), (
                    f"{name}:{ins.line}: {script} is used before it is copied"
                )
        for module in re.findall(r"python3? -m ([\w.]+)", text):
            if module.startswith("miles"):
                assert (REPO / (module.replace(".", "/") + ".py")).exists() or (
                    REPO / module.replace(".", "/") / "__main__.py"
                ).exists(), f"{name}:{ins.line}: module {module} does not exist"


def test_hadolint_style_rules(dockerfile):
    name, instructions = dockerfile
    assert instructions[0].op in ("ARG", "FROM"), name
    for ins in instructions:
        if ins.op == "RUN":
            if "pip install" in ins.args:
                assert "--no-cache-dir" in ins.args, f"{name}:{ins.line}: pip install without --no-cache-dir"
            if "apt-get install" in ins.args:
                assert "--no-install-recommends" in ins.args and "rm -rf /var/lib/apt/lists" in ins.args
            assert not ins.args.startswith("cd "), f"{name}:{ins.line}: use WORKDIR instead of cd"
        if ins.op == "WORKDIR":
            assert ins.args.startswith("/"), f"{name}:{ins.line}: WORKDIR must be absolute"
        if ins.op in ("CMD", "ENTRYPOINT"):
            assert isinstance(json.loads(ins.args), list), f"{name}:{ins.line}: use the exec (JSON) form"
    assert sum(i.op == "CMD" for i in instructions) == 1, name


def _extras_installed(instructions: list[Instruction]) -> set[str]:
    extras = set()
    for ins in instructions:
        for group in re.findall(r"\.\[([\w,-]+)\]", ins.args):
            extras.update(group.split(","))
    return extras


def _declared_extras() -> set[str]:
    """Names under [project.optional-dependencies] of pyproject.toml (tomllib needs Python 3.11)."""
    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, flags=re.M))


def test_gpu_image_builds_on_sglang_with_the_gpu_extra():
    instructions = parse(REPO / "Dockerfile")
    args = {}
    for ins in instructions:
        if ins.op == "ARG" and "=" in ins.args:
            key, value = ins.args.split("=", 1)
            args[key] = value
    (base,) = [i.args for i in instructions if i.op == "FROM"]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert base.startswith("lmsysorg/sglang:"), base
    declared = _declared_extras()
    extras = _extras_installed(instructions)
    assert "gpu" in extras and extras <= declared, (extras, declared)


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("## Two commands", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_cpu_image_runs_the_two_readme_commands():
    instructions = parse(REPO / "Dockerfile.cpu")
    (cmd,) = [i for i in instructions if i.op == "CMD"]
    words = json.loads(cmd.args)
    assert words[:2] == ["bash", "-c"]
    steps = [s.strip() for s in words[2].split("&&")]
    commands = _readme_commands()
    assert len(commands) == 2 and steps == commands, (steps, commands)
    assert "torch==" in " ".join(i.args for i in instructions if i.op in ("RUN", "ARG"))
    assert "test" in _extras_installed(instructions) or any(
        "scripts/install.sh test" in i.args for i in instructions if i.op == "RUN"
    )
