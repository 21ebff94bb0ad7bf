"""util.proc.run: a failing tool's error carries the command, the exit code and both streams."""

from __future__ import annotations

import sys

import pytest

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
