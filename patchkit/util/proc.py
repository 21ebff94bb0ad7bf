"""Run an external tool (pip, a compiler, a formatter): one helper, one error.

Commands are argument lists, never shell strings; output is captured as text.
A failure raises :class:`ToolError` with the command, the exit code and both
output streams, so the caller adds only what the user should do about it.
Project-agnostic, like :mod:`patchkit.util.git` (which runs git itself).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from os import PathLike
from pathlib import Path

from patchkit.errors import ToolError

NOT_FOUND = 127  # the shell's exit code for a command that does not exist


def run(
    cmd: Sequence[str | PathLike[str]],
    *,
    cwd: str | PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    timeout: float | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` and return it finished; with ``check``, a non-zero exit is a ToolError.

    A missing executable exits with 127, as in a shell: a ToolError with ``check``,
    else one more failing exit code for a probe to read.
    """
    argv = [str(c) for c in cmd]
    try:
        proc = subprocess.run(
            argv,
            cwd=cwd,
            env=None if env is None else dict(env),
            input=input,
            timeout=timeout,
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError as exc:
        if check:
            raise ToolError(argv, NOT_FOUND, "", f"{argv[0]}: not found") from exc
        return subprocess.CompletedProcess(argv, NOT_FOUND, "", f"{argv[0]}: not found")
    if check and proc.returncode != 0:
        raise ToolError(argv, proc.returncode, proc.stdout, proc.stderr)
    return proc


def cuda_tool(name: str, given: str | None = None) -> str | None:
    """A CUDA toolkit program (``compute-sanitizer``, ``ncu``): ``given`` (a path or a name
    on ``PATH``), else the one beside ``nvcc`` (the toolkit the build used), else ``name``
    on ``PATH``; None where there is none."""
    if given:
        return shutil.which(given)
    nvcc = shutil.which("nvcc")
    beside = Path(nvcc).resolve().parent / name if nvcc else None
    if beside is not None and beside.is_file():
        return str(beside)
    return shutil.which(name)


def interpreter(spec: str) -> tuple[str, str]:
    """A Python given as ``PYTHON[:SITE]`` (the scripts' way to name an MLX to run, such as
    stock's wheels unpacked into a folder): the interpreter and the folder to put first on
    its ``PYTHONPATH`` ("" where none is given). The first colon splits them."""
    python, _, site = spec.partition(":")
    return python, site


def exit_on_signal(signum: int, _frame: object) -> None:
    """A SIGTERM/SIGHUP handler that ends a script as an exception would, running its
    ``finally`` clean-up (as Ctrl-C does), with the shell's exit status for the signal."""
    raise SystemExit(128 + signum)


def stop_group(child: subprocess.Popen, grace: float) -> None:
    """End ``child``'s process group (started with ``start_new_session``): SIGTERM, up to
    ``grace`` seconds for the leader to end through its own clean-up, then SIGKILL for
    whatever of the group is left, the leader reaped. A leader that already ended still
    has what it left behind in its group killed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()
