"""The build's test step: one process per test method, summed into one unittest summary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from patchkit.carry import mlx_build
from patchkit.util import split_unittest
from tests.support_procs import ends_within, running

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


def test_only_runs_the_methods_named(tmp_path: Path) -> None:
    """``--only`` runs those methods and none other; a name the module lacks is a one-line
    usage error, before anything runs."""
    done = _run(tmp_path, "pass", "--jobs", "2", "--only", "test_passes", "--only", "test_skipped")
    assert done.returncode == 0, done.stdout + done.stderr
    headers = [ln for ln in done.stdout.splitlines() if ln.startswith("== ")]
    assert sorted(h.split(":")[0] for h in headers) == [
        "== test_mod.TestSome.test_passes", "== test_mod.TestSome.test_skipped"]  # fmt: skip
    assert done.stdout.splitlines()[-1] == "OK (skipped=1)"
    # control: the failing method named runs, and fails
    failing = _run(tmp_path, "pass", "--only", "test_two_subtests_fail")
    assert failing.returncode == 1 and failing.stdout.splitlines()[-1] == "FAILED (failures=2)"
    wrong = _run(tmp_path, "pass", "--only", "test_nothing")
    assert wrong.returncode == 2 and "has no test method test_nothing" in wrong.stderr
    assert "== " not in wrong.stdout


SLOW = """
import time, unittest

class TestSlow(unittest.TestCase):
    def test_a_sleeps(self):
        time.sleep(60)

    def test_b_would_pass(self):
        pass
"""


def test_a_deadline_stops_a_run_and_names_what_it_left(tmp_path: Path) -> None:
    (tmp_path / "test_slow.py").write_text(SLOW)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "patchkit.util.split_unittest", "test_slow", "--jobs", "1"]
    done = subprocess.run(
        [*argv, "--deadline-s", "3"], cwd=tmp_path, env=env, capture_output=True, text=True,
        check=False, timeout=40,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    # The sleeper is stopped at 3 s, and the method queued behind it never starts.
    assert done.returncode == 1 and lines[-1] == "FAILED (unfinished=2)", done.stdout
    results = mlx_build.method_results(lines)
    assert results["unfinished"] == ["test_a_sleeps", "test_b_would_pass"]
    assert results["cut_off"] == ["test_a_sleeps", "test_b_would_pass"]
    assert mlx_build.unittest_counts(lines)["ran"] == 0
    line = mlx_build.tests_line({"file": "t.py", **mlx_build.unittest_counts(lines), **results})
    assert "2 not finished in the time given: test_a_sleeps, test_b_would_pass" in line
    # Neither ran to its end, so neither says anything of its subtests.
    assert not any(map(split_unittest.ran_to_end, split_unittest.parse_output(lines).values()))
    # Control: without the deadline the same module's quick method passes (sleeper skipped).
    (tmp_path / "test_slow.py").write_text(SLOW.replace("time.sleep(60)", "pass"))
    quick = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, check=False)
    assert quick.returncode == 0 and mlx_build.method_results(quick.stdout.splitlines()) == {
        "per_test": {"test_a_sleeps": "passed", "test_b_would_pass": "passed"},
        "failing_subtests": {},
        "unfinished": [],
        "cut_off": [],
    }
    ended = split_unittest.parse_output(quick.stdout.splitlines())
    assert sorted(ended) == ["test_a_sleeps", "test_b_would_pass"]
    assert all(map(split_unittest.ran_to_end, ended.values()))


SLEEPER = """
import os, time, unittest
from pathlib import Path

class TestSleeper(unittest.TestCase):
    def test_sleeps(self):
        # A kernel module half written (no .txt beside it) when the run is stopped.
        Path(os.environ["MLX_PTX_CACHE_DIR"], "mod.ptx").write_text("half")
        Path("sleeper.pid").write_text(str(os.getpid()))
        time.sleep(60)
"""


@pytest.mark.parametrize(("sent", "left_running"), [
    (signal.SIGTERM, False),
    (signal.SIGKILL, True),  # control: no handler runs, and the method's process survives
])  # fmt: skip
def test_a_terminated_run_leaves_no_method_running(
    tmp_path: Path, sent: signal.Signals, left_running: bool
) -> None:
    """A method runs in its own process group, which the run's process group does not
    reach: SIGTERM to the run must still end it (a records run stopping its tests), and
    the run ends as at a deadline: the method unfinished, its torn JIT module dropped."""
    (tmp_path / "test_sleeper.py").write_text(SLEEPER)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cache = tmp_path / "ptx"
    run = subprocess.Popen(
        [sys.executable, "-m", "patchkit.util.split_unittest", "test_sleeper", "--jobs", "1",
         "--cache-root", str(cache)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    pid_file = tmp_path / "sleeper.pid"
    for _ in range(200):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.05)
    sleeper = int(pid_file.read_text())
    try:
        run.send_signal(sent)
        out, _ = run.communicate(timeout=10)
        assert run.returncode == (128 + sent if sent == signal.SIGTERM else -sent)
        assert ends_within(sleeper) is not left_running
        if not left_running:
            lines = out.splitlines()
            assert lines[-1] == "FAILED (unfinished=1)", out
            assert (
                "UNFINISHED: test_sleeps (test_sleeper.TestSleeper.test_sleeps) (stopped by "
                "SIGTERM)" in lines
            )
            assert not (cache / "test_sleeps" / "mod.ptx").exists()  # dropped, not published
            assert not list((cache / split_unittest.POOL).glob("*.ptx"))
        else:  # control: killed outright, the run drops nothing (and the path is right)
            assert (cache / "test_sleeps" / "mod.ptx").exists()
    finally:
        if running(sleeper):
            os.kill(sleeper, signal.SIGKILL)


def test_method_results_name_each_failing_subtest(tmp_path: Path) -> None:
    done = _run(tmp_path, "pass", "--jobs", "2")
    results = mlx_build.method_results(done.stdout.splitlines())
    assert results["per_test"]["test_two_subtests_fail"] == "failed"
    assert results["per_test"]["test_passes"] == "passed" and results["unfinished"] == []
    assert [s.split(") ", 1)[1] for s in results["failing_subtests"]["test_two_subtests_fail"]] == [
        "(k=1)", "(k=2)",
    ]  # fmt: skip
    # The record's line names the failed methods and how many subtests each failed.
    counts = mlx_build.unittest_counts(done.stdout.splitlines())
    line = mlx_build.tests_line({"file": "t.py", **counts, **results})
    assert "failed: test_two_subtests_fail (2 subtests)" in line, line
    # A method skipped as a whole is "skipped", not unittest's "ok" (the PR's body quotes
    # its own tests' verdicts from here).
    assert results["per_test"]["test_skipped"] == "skipped"
    assert results["per_test"]["test_passes"] == "passed"  # control: a method that ran
    # A run that started from a warm JIT cache says so; a cold one (0) says nothing.
    warm = mlx_build.tests_line({"file": "t.py", **counts, **results, "jit_kernels_at_start": 7})
    assert "the run started with 7 JIT kernels already in this version's JIT cache" in warm
    assert "JIT kernels" not in mlx_build.tests_line(
        {"file": "t.py", **counts, **results, "jit_kernels_at_start": 0, "jit_kernels_at_end": 3}
    )
    # A run cut off at its deadline says what it leaves for the next run of the version.
    cut = {**counts, **results, "unfinished": ["test_slow"]}
    line = mlx_build.tests_line({"file": "t.py", **cut, "jit_kernels_at_end": 40})
    assert "1 not finished in the time given: test_slow; 40 JIT kernels are left" in line, line
    assert "JIT kernels" not in mlx_build.tests_line({"file": "t.py", **cut})  # not counted


ORDERED = """
import time, unittest

class TestOrder(unittest.TestCase):
    def test_a_quick(self):
        pass

    def test_b_slow(self):
        time.sleep(1.5)
"""


def test_a_rerun_starts_the_longest_method_first(tmp_path: Path) -> None:
    (tmp_path / "test_order.py").write_text(ORDERED)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "patchkit.util.split_unittest", "test_order", "--jobs", "1",
            "--cache-root", str(tmp_path / "ptx")]  # fmt: skip

    def started() -> list[str]:
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                              check=False)  # fmt: skip
        assert done.returncode == 0, done.stdout
        return [ln.split(":")[0].rsplit(".", 1)[-1] for ln in done.stdout.splitlines()
                if ln.startswith("== ")]  # fmt: skip

    # Control: nothing timed yet, so unittest's order (one at a time: ends = starts).
    assert started() == ["test_a_quick", "test_b_slow"]
    durations = json.loads((tmp_path / "ptx" / "durations.json").read_text())
    assert durations["test_b_slow"] > durations["test_a_quick"]
    assert started() == ["test_b_slow", "test_a_quick"]
    # A method stopped unfinished is ordered before every timed one.
    (tmp_path / "ptx" / "durations.json").write_text('{"test_a_quick": null, "test_b_slow": 9}')
    assert started() == ["test_a_quick", "test_b_slow"]
    # --first (a change's own tests) goes before the unfinished and the longest.
    argv += ["--first", "test_b_slow"]
    (tmp_path / "ptx" / "durations.json").write_text('{"test_a_quick": null, "test_b_slow": 9}')
    assert started() == ["test_b_slow", "test_a_quick"]


def _split(
    tmp_path: Path, module: str, source: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """``split_unittest MODULE ARGS`` on ``source`` written as ``tmp_path/MODULE.py``."""
    (tmp_path / f"{module}.py").write_text(source)
    return subprocess.run(
        [sys.executable, "-m", "patchkit.util.split_unittest", module, *args],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, check=False, timeout=120,
    )  # fmt: skip


SHARDED = """
import os, unittest
from pathlib import Path

def mark(name):
    with open("ran.txt", "a") as f:
        f.write(name + "\\n")

class TestShards(unittest.TestCase):
    def test_grid(self):
        mark("grid-setup")
        for i in range(10):
            with self.subTest(i=i):
                mark(f"grid-{i}")
                for j in range(2):
                    with self.subTest(i=i, j=j):
                        mark(f"grid-{i}-{j}")
                self.assertNotEqual(i, 7)

    def test_plain(self):
        mark("plain")

    @unittest.skip("not here")
    def test_skipped(self):
        with self.subTest(k=0):
            mark("skipped")

    def test_uneven(self):
        cache = os.environ.get("MLX_PTX_CACHE_DIR", "")
        for i in range(3 + {uneven} * cache.endswith(".1")):
            with self.subTest(i=i):
                pass
"""


def _sharded(tmp_path: Path, uneven: int) -> subprocess.CompletedProcess[str]:
    (tmp_path / "ran.txt").unlink(missing_ok=True)
    return _split(tmp_path, "test_shards", SHARDED.replace("{uneven}", str(uneven)), "--jobs",
                  "4", "--shards", "3", "--cache-root", str(tmp_path / "ptx"))  # fmt: skip


def test_shards_run_every_subtest_once_and_count_each_method_once(tmp_path: Path) -> None:
    done = _sharded(tmp_path, uneven=0)
    lines = done.stdout.splitlines()
    ran = (tmp_path / "ran.txt").read_text().splitlines()
    # Every top-level subtest, with its nested ones, ran in exactly one shard; the code
    # outside subtests twice in each of the three (the count, then the run); a method
    # without subtests once, unsharded.
    wanted = [f"grid-{i}" for i in range(10)] + [f"grid-{i}-{j}" for i in range(10) for j in (0, 1)]
    assert sorted(n for n in ran if n.startswith("grid-") and n != "grid-setup") == sorted(wanted)
    assert ran.count("grid-setup") == 6 and ran.count("plain") == 1 and "skipped" not in ran
    assert sum(ln.startswith("== test_shards.TestShards.test_grid [") for ln in lines) == 3
    # The one failing subtest is one failure of one method; four methods ran, one skipped.
    assert done.returncode == 1 and lines[-1] == "FAILED (failures=1, skipped=1)", done.stdout
    counts = mlx_build.unittest_counts(lines)
    assert (counts["ran"], counts["passed"], counts["failed"], counts["skipped"]) == (4, 2, 1, 1)
    results = mlx_build.method_results(lines)
    assert results["per_test"]["test_grid"] == "failed"
    assert [s.split(") ", 1)[1] for s in results["failing_subtests"]["test_grid"]] == ["(i=7)"]
    assert results["per_test"]["test_uneven"] == "passed"
    # Each shard its own JIT cache; the method's time is kept once, for the next order.
    assert json.loads((tmp_path / "ptx" / "durations.json").read_text()).keys() == {
        "test_grid", "test_plain", "test_skipped", "test_uneven",
    }  # fmt: skip


def test_shards_that_disagree_on_the_subtests_are_an_error(tmp_path: Path) -> None:
    # Shard 1 of test_uneven enters two more subtests than the others: which ran is unknown.
    done = _sharded(tmp_path, uneven=2)
    lines = done.stdout.splitlines()
    errors = [ln for ln in lines if ln.startswith("ERROR: test_uneven")]
    assert len(errors) == 1 and "shards entered [3, 5] subtests" in errors[0], done.stdout
    assert mlx_build.method_results(lines)["per_test"]["test_uneven"] == "failed"


EDGES = """
import os, unittest

def annotated(x: int) -> None:
    pass

class TestA(unittest.TestCase):
    def test_x(self):
        # A set of strings: its order follows the hash seed of the process.
        for name in {"alpha", "beta", "gamma", "delta", "epsilon", "zeta"}:
            with self.subTest(name=name):
                self.assertNotEqual(name, "gamma")

    def test_annotations_are_objects(self):
        for k in range(2):
            with self.subTest(k=k):
                self.assertIs(annotated.__annotations__["x"], int)

    def test_other_params(self):
        # Same count in every shard, other parameters in shard 1: which ran is unknown.
        shard_one = os.environ.get("MLX_PTX_CACHE_DIR", "").endswith(".1")
        for k in range(3):
            with self.subTest(k=k + 10 * shard_one):
                pass

@unittest.skip("whole class")
class TestB(unittest.TestCase):
    def test_x(self):
        for k in range(3):
            with self.subTest(k=k):
                os.abort()
"""


def test_shards_agree_on_order_and_keep_classes_apart(tmp_path: Path) -> None:
    for _ in range(3):  # the set's order must not decide which shard runs "gamma"
        done = _split(tmp_path, "test_edges", EDGES, "--jobs", "4", "--shards", "3",
                      "--cache-root", str(tmp_path / "ptx"))  # fmt: skip
        lines = done.stdout.splitlines()
        problems = [ln for ln in lines if ln.startswith(("FAIL:", "ERROR:"))]
        assert sorted(problems) == [
            "ERROR: test_other_params (test_edges.TestA.test_other_params) (shards entered 3 "
            "other subtests)",
            "FAIL: test_x (test_edges.TestA.test_x) (name='gamma')",
        ], done.stdout
        # Four methods in two classes; the skipped class is not sharded (no abort).
        assert len(problems) == 2 and lines[-1] == "FAILED (failures=1, errors=1, skipped=1)"
        assert not any("TestB.test_x [" in ln for ln in lines)


SKIPS = """
import unittest

class TestSkips(unittest.TestCase):
    def test_skips_itself(self):
        self.skipTest("not on this device")
        for k in range(4):
            with self.subTest(k=k):
                pass

    def test_skips_subtests(self):
        for k in range(6):
            with self.subTest(k=k):
                if k % 2:
                    self.skipTest("odd")
"""


def test_a_sharded_method_that_skips_itself_is_one_skip(tmp_path: Path) -> None:
    done = _split(tmp_path, "test_skips", SKIPS, "--jobs", "4", "--shards", "3")
    # One method skipped in every shard counts once; three skipped subtests, three.
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "OK (skipped=4)", done.stdout


def test_on_a_fresh_host_the_sharded_methods_start_first(tmp_path: Path) -> None:
    module = "import unittest\n\nclass T(unittest.TestCase):\n    def test_a_plain(self):\n" \
        "        pass\n\n    def test_b_grid(self):\n        for k in range(2):\n" \
        "            with self.subTest(k=k):\n                pass\n"  # fmt: skip
    done = _split(tmp_path, "test_fresh", module, "--jobs", "1", "--shards", "2")
    started = [ln.split(":")[0] for ln in done.stdout.splitlines() if ln.startswith("== ")]
    # One at a time, so ends = starts: both shards of the grid, then the plain method
    # (unittest's order, the control, would start test_a_plain first).
    assert started == ["== test_fresh.T.test_b_grid [0/2]", "== test_fresh.T.test_b_grid [1/2]",
                       "== test_fresh.T.test_a_plain"], done.stdout  # fmt: skip


GPU_MODULE = """
import os, unittest
from pathlib import Path

class TestGpu(unittest.TestCase):
    def test_a(self):
        Path("gpu-a").write_text(os.environ["CUDA_VISIBLE_DEVICES"])

    def test_b(self):
        Path("gpu-b").write_text(os.environ["CUDA_VISIBLE_DEVICES"])

    def test_c(self):
        Path("gpu-c").write_text(os.environ["CUDA_VISIBLE_DEVICES"])
"""


def test_processes_are_spread_over_the_visible_gpus(tmp_path: Path) -> None:
    (tmp_path / "test_gpu.py").write_text(textwrap.dedent(GPU_MODULE))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "4,5"}
    done = subprocess.run(
        [sys.executable, "-m", "patchkit.util.split_unittest", "test_gpu", "--jobs", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    seen = [(tmp_path / f"gpu-{m}").read_text() for m in "abc"]
    assert seen == ["4", "5", "4"]


def test_jit_processes_are_held_to_the_memory_available() -> None:
    """As many processes as the memory holds at the allowance each, at least one; no
    limit where the memory is unknown or the allowance is 0."""
    gib = 1 << 30
    assert split_unittest.jit_jobs(16, 120 * gib, 8) == 15
    assert split_unittest.jit_jobs(16, 32 * gib, 8) == 4
    assert split_unittest.jit_jobs(16, gib, 8) == 1
    assert split_unittest.jit_jobs(4, 120 * gib, 8) == 4
    assert split_unittest.jit_jobs(16, None, 8) == 16 and split_unittest.jit_jobs(16, gib, 0) == 16
    if Path("/proc/meminfo").is_file():
        assert (split_unittest.memory_available() or 0) > 0


def test_a_run_that_compiles_cuda_kernels_takes_fewer_slots_where_memory_is_short(
    tmp_path: Path,
) -> None:
    """With ``--cache-root``, an allowance no host has leaves one process at a time, and
    the first line says why; the verdicts are those of a run with every slot. Controls: an
    allowance of 0, and no ``--cache-root``, keep the slots asked for."""
    ptx = str(tmp_path / "ptx")
    held = _run(tmp_path, "pass", "--jobs", "3", "--cache-root", ptx, "--jit-memory-gib", "1e9")
    first = held.stdout.splitlines()[0]
    assert "1 at a time (not 3: " in first and "1e+09 GiB a process" in first, first
    assert held.stdout.splitlines()[-1] == "FAILED (failures=2, skipped=1)"
    free = _run(tmp_path, "pass", "--jobs", "3", "--cache-root", ptx, "--jit-memory-gib", "0")
    assert free.stdout.splitlines()[0].endswith("3 at a time")
    plain = _run(tmp_path, "pass", "--jobs", "3", "--jit-memory-gib", "1e9")
    assert plain.stdout.splitlines()[0].endswith("3 at a time")
