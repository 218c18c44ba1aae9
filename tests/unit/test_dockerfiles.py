"""Static checks of Dockerfile and Dockerfile.cpu (no Docker engine runs in the test environment): every file
they copy and every script, module and extra they use exists in the repository, nothing they need is excluded by
.dockerignore, files are copied before a RUN uses them, a few hadolint-style rules hold, the GPU image builds on
lmsysorg/sglang with the `gpu` extra, and the CPU image runs the README's two commands. The images' Python pins
agree with pyproject.toml: the GPU base is the SGLang release the `gpu` extra and the conformance venv pin, the CPU
image's torch and Python satisfy pyproject and equal install.sh's CPU torch; the `gpu` extra names only vetted
packages."""

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


# ---- the images' Python pins agree with pyproject.toml ----------------------------------------------------------

# every package of the `gpu` extra and why it is there; a new one is added here with its reason, deliberately
VETTED_GPU_PACKAGES = {
    "sglang": "the rollout engine (the release the engine contract is tested against)",
    "torch-memory-saver": "SGLang's memory saver: colocated engines release and resume their GPU memory",
    "flash-attn": "FlashAttention-2 varlen kernels (--attn-implementation flash_attention_2, miles_varlen on CUDA)",
    "ring-flash-attn": "context-parallel attention on CUDA (its llama3 varlen kernel)",
}


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _requirements(names: list[str]) -> dict:
    from packaging.requirements import Requirement

    return {(r := Requirement(s)).name: r for s in names}


def _dockerfile_args(name: str) -> dict[str, str]:
    return dict(i.args.split("=", 1) for i in parse(REPO / name) if i.op == "ARG" and "=" in i.args)


def test_gpu_extra_names_only_vetted_packages():
    gpu = _requirements(_pyproject()["project"]["optional-dependencies"]["gpu"])
    assert set(gpu) == set(VETTED_GPU_PACKAGES), set(gpu) ^ set(VETTED_GPU_PACKAGES)
    assert "deep-gemm" not in gpu  # the PyPI name is not DeepSeek's DeepGEMM (which SGLang's image brings)


def test_gpu_image_sglang_is_the_release_the_gpu_extra_and_the_contract_pin():
    base = _dockerfile_args("Dockerfile")["BASE_IMAGE"]
    match = re.fullmatch(r"lmsysorg/sglang:v(\d+\.\d+\.\d+(?:\.post\d+)?)(?:-cu\d+)?", base)
    assert match, f"the GPU image's base must be a pinned SGLang release tag, got {base}"
    version = match.group(1)
    (spec,) = _requirements(_pyproject()["project"]["optional-dependencies"]["gpu"])["sglang"].specifier
    assert (spec.operator, spec.version) == ("==", version), (str(spec), base)
    venv_pins = re.findall(r'"sglang==([\w.]+)"', (REPO / "scripts" / "sglang-venv.sh").read_text())
    assert venv_pins == [version], ("scripts/sglang-venv.sh, the conformance suite's sglang", venv_pins)
    # the ring-flash-attn miles calls on GPU is the one the CPU test runs
    extras = _pyproject()["project"]["optional-dependencies"]
    ring = {extra: _requirements(extras[extra])["ring-flash-attn"].specifier for extra in ("gpu", "test")}
    assert ring["gpu"] == ring["test"] and str(ring["gpu"]).startswith("=="), ring


def test_cpu_image_pins_agree_with_pyproject_and_install_script():
    from packaging.specifiers import SpecifierSet

    project = _pyproject()["project"]
    args = _dockerfile_args("Dockerfile.cpu")
    torch_pin = args["TORCH_VERSION"]
    assert torch_pin in _requirements(project["dependencies"])["torch"].specifier, torch_pin
    install_pins = re.findall(r"torch==([\w.]+)", (REPO / "scripts" / "install.sh").read_text())
    assert install_pins and set(install_pins) == {torch_pin}, ("scripts/install.sh CPU torch", install_pins)
    (base,) = [i.args for i in parse(REPO / "Dockerfile.cpu") if i.op == "FROM"]
    python = re.fullmatch(r"python:(\d+\.\d+)(?:\.\d+)?-slim", base)
    assert python, base
    requires = SpecifierSet(project["requires-python"])
    assert python.group(1) + ".0" in requires, (base, str(requires))
