"""`patchkit build`: MLX's own documented build of a patched tree, then `patchkit parity`.

We add nothing to MLX's build: it is ``pip install .`` in the tree, with the
``CMAKE_ARGS`` MLX's install docs give per platform (Metal on macOS,
``-DMLX_BUILD_CUDA=ON`` on Linux with CUDA, CPU otherwise). :func:`plan` is
pure: it returns the exact commands and environment, which ``--dry-run`` prints
and the tests check; :func:`execute` runs them with the whole output kept in
``<worktree>/.patchkit-build/build.log``.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from patchkit.carry import apply, pin, source
from patchkit.errors import ToolError, UserError

BACKENDS = ("metal", "cuda", "cpu")
# MLX docs/src/install.rst and setup.py (which reads CMAKE_ARGS) at the pin.
CMAKE_ARGS = {
    "metal": "-DMLX_BUILD_METAL=ON",
    "cuda": "-DMLX_BUILD_CUDA=ON",
    "cpu": "-DMLX_BUILD_METAL=OFF",
}
# Wheels whose backend libraries would shadow the ones the build installs.
WHEELS = ("mlx", "mlx-metal", "mlx-cpu", "mlx-cuda-12", "mlx-cuda-13")
LOG_DIR = ".patchkit-build"


@dataclass(frozen=True)
class Step:
    """One command of the build, with why it is there."""

    why: str
    argv: list[str]
    cwd: Path
    env: dict[str, str] = field(default_factory=dict)  # added to the inherited environment
    ok_codes: tuple[int, ...] = (0,)

    def shell(self) -> str:
        """The step as one copy-pasteable shell line."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (
            f"cd {shlex.quote(str(self.cwd))} && {env + ' ' if env else ''}{shlex.join(self.argv)}"
        )


@dataclass(frozen=True)
class BuildPlan:
    """Everything `patchkit build` will run, in order."""

    backend: str
    worktree: Path
    log: Path
    steps: list[Step]

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "worktree": str(self.worktree),
            "log": str(self.log),
            "steps": [
                {"why": s.why, "argv": s.argv, "cwd": str(s.cwd), "env": s.env} for s in self.steps
            ],
        }

    def describe(self) -> str:
        return "\n".join(f"# {s.why}\n{s.shell()}" for s in self.steps)


def detect_backend(system: str | None = None, has_nvcc: bool | None = None) -> str:
    """Metal on macOS, CUDA on Linux with ``nvcc`` on PATH, else CPU."""
    system = system or platform.system()
    has_nvcc = shutil.which("nvcc") is not None if has_nvcc is None else has_nvcc
    return "metal" if system == "Darwin" else ("cuda" if has_nvcc else "cpu")


def plan(
    root: Path,
    *,
    worktree: Path | None = None,
    backend: str | None = None,
    mlx_repo: str | None = None,
    python: str = sys.executable,
) -> BuildPlan:
    """The build's commands; touches nothing. No ``worktree``: check out the applied branch."""
    backend = backend or detect_backend()
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    steps = []
    if worktree is None:
        p = pin.load(root / pin.PIN_FILE)
        clone = source.clone_dir(source.source_spec(mlx_repo, p.url))
        worktree = root / "build" / f"mlx-{p.short}"
        branch = apply.BRANCH_PREFIX + p.short
        steps.append(
            Step(
                f"check out {branch} (made by `patchkit apply`) to build it",
                ["git", "-C", str(clone), "worktree", "add", "--detach", str(worktree), branch],
                root,
            )
        )
    worktree = worktree.resolve()
    logs = worktree / LOG_DIR
    steps += [
        Step(
            "remove MLX wheels, whose backend libraries would shadow the build",
            [python, "-m", "pip", "uninstall", "-y", *WHEELS],
            worktree,
        ),
        Step(
            f"MLX's documented Python build, {backend} backend",
            [python, "-m", "pip", "install", "-v", "."],
            worktree,
            {"CMAKE_ARGS": CMAKE_ARGS[backend], "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count())},
        ),
        Step(
            "bitwise parity of the MLX just built (exit 1 = rows differ, still a result)",
            [python, "-c", "from patchkit.cli import main; main()", "parity", "--quick",
             "--out", str(logs / "parity.json")],
            logs,  # not the tree: its mlx/ folder must not shadow the installed package
            ok_codes=(0, 1),
        ),
    ]  # fmt: skip
    return BuildPlan(backend, worktree, logs / "build.log", steps)


def _run_logged(step: Step, log: TextIO, progress: Callable[[str], None]) -> int:
    """Run ``step`` with its output appended to ``log``; progress gets its latest line."""
    log.write(f"\n$ {step.shell()}\n")
    log.flush()
    env = {**os.environ, **step.env}
    with subprocess.Popen(
        step.argv, cwd=step.cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    ) as proc:  # fmt: skip
        for line in proc.stdout or ():
            log.write(line)
            if line.strip():
                progress(line.strip()[:100])
    return proc.returncode


def _checkout(step: Step) -> str:
    """The ``git worktree add`` step, run before the log exists (git wants an empty target)."""
    proc = subprocess.run(step.argv, cwd=step.cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ToolError(step.argv, proc.returncode, proc.stdout, proc.stderr)
    return f"$ {step.shell()}\n{proc.stdout}{proc.stderr}"


def execute(build: BuildPlan, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run the plan; a failing step raises a ToolError pointing at the kept log."""
    steps, head = list(build.steps), ""
    if steps[0].argv[0] == "git":
        progress(f"[1/{len(steps)}] {steps[0].why}")
        head = _checkout(steps.pop(0))
    if not (build.worktree / "setup.py").is_file():
        raise UserError(f"{build.worktree} is not an MLX checkout (no setup.py)")
    build.log.parent.mkdir(parents=True, exist_ok=True)
    codes = []
    with build.log.open("a") as log:
        log.write(head)
        for i, step in enumerate(steps, len(build.steps) - len(steps) + 1):
            progress(f"[{i}/{len(build.steps)}] {step.why}")
            code = _run_logged(step, log, progress)
            codes.append(code)
            if code not in step.ok_codes:
                raise ToolError(step.argv, code, "", f"see the full log: {build.log}")
    return {**build.to_json(), "parity_identical": codes[-1] == 0, "exit_codes": codes}
