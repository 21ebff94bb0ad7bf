"""util.proc.run: a failing tool's error carries the command, the exit code and both streams;
util.proc.stop_group: a stopped process group leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support_procs import ends_within

from patchkit.errors import ToolError
from patchkit.util import proc

FAIL = "import sys; print('out'); print('why', file=sys.stderr); sys.exit(3)"


def test_success_returns_the_output() -> None:
    assert proc.run([sys.executable, "-c", "print('hi')"]).stdout == "hi\n"


def test_failure_carries_command_code_and_both_streams() -> None:
    with pytest.raises(ToolError) as caught:
        proc.run([sys.executable, "-c", FAIL])
    err = caught.value
    assert (err.cmd, err.returncode, err.stdout, err.stderr) == (
        [sys.executable, "-c", FAIL],
        3,
        "out\n",
        "why\n",
    )
    assert "exited with 3" in str(err) and "why" in str(err)
    assert proc.run([sys.executable, "-c", FAIL], check=False).returncode == 3  # a probe


def test_missing_executable_exits_127() -> None:
    with pytest.raises(ToolError, match="exited with 127"):
        proc.run(["patchkit-no-such-tool"])
    assert proc.run(["patchkit-no-such-tool"], check=False).returncode == proc.NOT_FOUND


@pytest.mark.parametrize(
    ("spec", "parts"),
    [
        ("python3", ("python3", "")),
        ("/opt/venv/bin/python:/tmp/stock", ("/opt/venv/bin/python", "/tmp/stock")),
        # The first colon splits: a site of several folders stays one PYTHONPATH.
        ("python3:/a:/b", ("python3", "/a:/b")),
    ],
)
def test_an_interpreter_spec_is_a_python_and_its_site(spec: str, parts: tuple) -> None:
    assert proc.interpreter(spec) == parts


@pytest.mark.parametrize("leader", ["ends on TERM", "already ended"])
def test_stop_group_leaves_nothing_of_the_group(tmp_path: Path, leader: str) -> None:
    """A straggler that ignores SIGTERM is killed with its group, whether the leader ends on
    the TERM or had already ended; the leader is reaped."""
    pid_file = tmp_path / "pid"
    script = (f"(trap '' TERM; echo $BASHPID > {pid_file}; sleep 60) & "
              + ("wait" if leader == "ends on TERM" else "sleep 0.3"))  # fmt: skip
    child = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    deadline = time.monotonic() + 10
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    straggler = int(pid_file.read_text())
    if leader == "already ended":
        child.wait(timeout=10)
    proc.stop_group(child, grace=2)
    assert child.returncode is not None
    alive = not ends_within(straggler, 10)
    if alive:  # a failing test leaves nothing running
        os.kill(straggler, 9)
    assert not alive
