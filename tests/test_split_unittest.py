"""The build's test step: one process per test method, summed into one unittest summary."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from patchkit.carry import mlx_build

ROOT = Path(__file__).resolve().parent.parent

MODULE = """
import os, signal, unittest
from pathlib import Path

class TestSome(unittest.TestCase):
    def test_passes(self):
        Path("cache-" + self._testMethodName).write_text(os.environ.get("MLX_PTX_CACHE_DIR", ""))
        self.assertEqual(1 + 1, 2)

    def test_two_subtests_fail(self):
        for k in range(3):
            with self.subTest(k=k):
                self.assertLess(k, 1)

    @unittest.skip("not here")
    def test_skipped(self):
        pass

    def test_crashes(self):
        {crash}
"""


def _run(tmp_path: Path, crash: str, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_mod.py").write_text(textwrap.dedent(MODULE).format(crash=crash))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "patchkit.util.split_unittest", "test_mod", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_methods_run_apart_and_sum_to_one_summary(tmp_path: Path) -> None:
    done = _run(tmp_path, "os.kill(os.getpid(), signal.SIGSEGV)", "--jobs", "3",
                "--cache-root", str(tmp_path / "ptx"))  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    counts = mlx_build.unittest_counts(lines)
    # 4 methods: one passes, one fails (two subtests), one is skipped, one dies by a signal.
    assert (counts["ran"], counts["passed"], counts["failed"], counts["errors"]) == (4, 1, 1, 1)
    assert counts["skipped"] == 1 and counts["failures_reported"] == 2
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    assert len(errors) == 1 and "test_crashes" in errors[0] and "signal 11" in errors[0]
    # Each method its own JIT cache folder, under the root given.
    assert (tmp_path / "cache-test_passes").read_text() == str(tmp_path / "ptx" / "test_passes")


def test_all_passing_is_ok_and_exit_zero(tmp_path: Path) -> None:
    # Control for the above: the same module with nothing failing or dying ends "OK".
    done = _run(tmp_path, "pass", "--jobs", "2")
    assert done.returncode == 1 and done.stdout.splitlines()[-1] == "FAILED (failures=2, skipped=1)"
    module = (tmp_path / "test_mod.py").read_text().replace("assertLess(k, 1)", "assertLess(k, 3)")
    (tmp_path / "test_mod.py").write_text(module)
    ok = subprocess.run(
        [sys.executable, "-m", "patchkit.util.split_unittest", "test_mod", "--jobs", "2"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stdout
    assert ok.stdout.splitlines()[-1] == "OK (skipped=1)"
    assert mlx_build.unittest_counts(ok.stdout.splitlines())["passed"] == 3
