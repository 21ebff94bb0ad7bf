"""The device pipeline's peer and test steps (``scripts/cuda_build_device.sh``), rehearsed here.

A GPU lease is short and scarce, so the shell logic it runs is checked on a tiny CMake
project laid out like ``patchkit build``'s worktree: a peer's source compiled beside the
build with the build's own command, swapped in as an object, relinked only (not rebuilt
from the tree's source, which would time the patch under the peer's name); and MLX's tests
one process each, stopped, found unfinished and run again, with one verdict per test.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "cuda_build_device.sh"
TOOLS = [shutil.which(t) for t in ("cmake", "ninja", "c++", "git")]

needs_tools = pytest.mark.skipif(
    not all(TOOLS), reason="needs cmake, ninja, a C++ compiler and git on PATH"
)


def _bash(work: Path, repo: Path, script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` after sourcing the pipeline's functions, with WORK and REPO set.

    The script keeps the pipeline's ``set -euo pipefail``: a step that would abort the
    pipeline on the GPU host aborts here too.
    """
    prelude = (
        f"export PATCHKIT_DEVICE_WORK={work} REPO={repo}\nsource {SCRIPT} functions {work}/out\n"
    )
    return subprocess.run(
        ["bash", "-c", prelude + script], capture_output=True, text=True, timeout=300
    )


def _build_tree(work: Path) -> Path:
    """A worktree with a CMake library ``mlx`` built by ninja; returns its build folder."""
    wt = work / "cache" / "builds" / "cuda-t" / "mlx"
    (wt / "mlx" / "k").mkdir(parents=True)
    (wt / "CMakeLists.txt").write_text(
        textwrap.dedent(
            """\
            cmake_minimum_required(VERSION 3.20)
            project(t LANGUAGES CXX)
            add_library(mlx SHARED mlx/k/qmv.cpp mlx/k/other.cpp)
            target_include_directories(mlx PRIVATE ${CMAKE_SOURCE_DIR})
            install(TARGETS mlx LIBRARY DESTINATION ${CMAKE_SOURCE_DIR}/build/lib.x/mlx/lib)
            """
        )
    )
    (wt / "mlx" / "k" / "h.h").write_text("#define VAL 1\n")
    (wt / "mlx" / "k" / "qmv.cpp").write_text(
        '#include "h.h"\nextern "C" int which() { return VAL; }\n'
    )
    (wt / "mlx" / "k" / "other.cpp").write_text('extern "C" int other() { return 7; }\n')
    git = ["git", "-C", str(wt), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "tree"], check=True)
    tdir = wt / "build" / "temp.x" / "mlx.core"
    subprocess.run(
        ["cmake", "-S", str(wt), "-B", str(tdir), "-G", "Ninja"], check=True, capture_output=True
    )
    subprocess.run(
        ["cmake", "--build", str(tdir), "--target", "install"], check=True, capture_output=True
    )
    site = work / "cache" / "builds" / "cuda-t" / "venv" / "lib" / "python3.x" / "site-packages"
    shutil.copytree(wt / "build" / "lib.x" / "mlx", site / "mlx")
    return tdir


def _which(lib: Path) -> int:
    """``which()`` of the tiny ``libmlx.so``, loaded in a child process: loaded here, its
    soname would shadow MLX's own library for any later ``import mlx.core`` of this run."""
    code = "import ctypes, sys; print(ctypes.CDLL(sys.argv[1]).which())"
    got = subprocess.run(
        [sys.executable, "-c", code, str(lib)], capture_output=True, text=True, check=True
    )
    return int(got.stdout)


@needs_tools
@pytest.mark.skipif(sys.platform != "linux", reason="the pipeline runs on Linux GPU hosts")
def test_peer_object_is_swapped_in_and_only_relinked(tmp_path: Path) -> None:
    work, repo = tmp_path / "work", tmp_path / "repo"
    tdir = _build_tree(work)
    peer = repo / ".peer" / "px" / "mlx" / "k"
    peer.mkdir(parents=True)
    (peer / "qmv.cpp").write_text('#include "h.h"\nextern "C" int which() { return VAL + 41; }\n')
    touch_done = f"touch {work}/build.done\n"
    got = _bash(
        work, repo, touch_done + 'gather_carried\npeer_objects\npeer_build "$WORK/peer-src/px"'
    )
    assert got.returncode == 0, got.stderr + (work / "pipeline.log").read_text()
    site = Path(got.stdout.strip().splitlines()[-1])
    assert site == work / "peer-px"
    log = (work / "pipeline.log").read_text()
    assert "peer px: mlx/k/qmv.cpp compiled" in log
    relink = (work / "peer-px.build.log").read_text()
    assert "Building CXX object" not in relink and "Linking CXX shared library" in relink
    assert _which(site / "mlx" / "lib" / "libmlx.so") == 42  # the peer's code
    # The tree is the patched one again: the next build relinks its own object.
    assert not (tdir / "libmlx.so").exists()
    subprocess.run(["cmake", "--build", str(tdir)], check=True, capture_output=True)
    assert _which(tdir / "libmlx.so") == 1
    assert not list((work / "cache").rglob("*.peer-px.cpp"))  # the copy beside it is gone


@needs_tools
@pytest.mark.skipif(sys.platform != "linux", reason="the pipeline runs on Linux GPU hosts")
def test_a_rebuilt_object_fails_the_peer(tmp_path: Path) -> None:
    """The control: an object ninja rebuilds from the tree's source is not the peer."""
    work, repo = tmp_path / "work", tmp_path / "repo"
    _build_tree(work)
    peer = repo / ".peer" / "px" / "mlx" / "k"
    peer.mkdir(parents=True)
    (peer / "qmv.cpp").write_text('#include "h.h"\nextern "C" int which() { return 42; }\n')
    # A header newer than every object: ninja must rebuild qmv.cpp.o from the tree.
    script = (
        f"touch {work}/build.done\ngather_carried\npeer_objects\n"
        f"sleep 1; touch {work}/cache/builds/cuda-t/mlx/mlx/k/h.h\n"
        'if peer_build "$WORK/peer-src/px"; then echo rc=0; else echo rc=1; fi'
    )
    got = _bash(work, repo, script)
    assert "rc=1" in got.stdout
    assert "was recompiled from the build tree's source" in (work / "pipeline.log").read_text()


def _tests_tree(work: Path) -> Path:
    """The build's test folder and its venv's python (this interpreter); returns the folder."""
    tests = work / "cache" / "builds" / "cuda-t" / "mlx" / "python" / "tests"
    tests.mkdir(parents=True)
    venv_bin = work / "cache" / "builds" / "cuda-t" / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(sys.executable)
    runner = work.parent / "scripts" / "mlx_test_shard.py"  # $repo/scripts, REPO=work's parent
    runner.parent.mkdir(exist_ok=True)
    runner.symlink_to(ROOT / "scripts" / "mlx_test_shard.py")
    return tests


def _test_file(work: Path, source: str) -> None:
    """The build's test folder (:func:`_tests_tree`), holding ``source`` as MLX's test file."""
    (_tests_tree(work) / "test_quantized.py").write_text(textwrap.dedent(source))


def test_tests_run_stop_rerun_and_summary(tmp_path: Path) -> None:
    work = tmp_path / "work"
    _test_file(
        work,
        """\
        import time, unittest
        class TestQuantized(unittest.TestCase):
            def test_ok(self):
                pass
            def test_subfail(self):
                for i in range(3):
                    with self.subTest(i=i):
                        self.assertEqual(i % 2, 0)
            def test_slow(self):
                time.sleep(4)
        """,
    )
    names = "\n".join(
        f"test_quantized.TestQuantized.{t}" for t in ("test_ok", "test_subfail", "test_slow")
    )
    script = (
        f"printf '%s\\n' {' '.join(names.split())} > $WORK/names\n"
        'tests_run first "$WORK/names" &\n'
        "sleep 2; tests_stop first; wait\n"
        'tests_unfinished "$WORK/names" > "$WORK/left"; cat "$WORK/left"; echo ---\n'
        'tests_summary "$WORK/names"; echo ---\n'
        'tests_run again "$WORK/left"\n'
        'tests_summary "$WORK/names"\n'
    )
    got = _bash(work, tmp_path, script)
    assert got.returncode == 0, got.stderr
    left, stopped, summary = got.stdout.split("---\n")
    assert left.split() == ["test_quantized.TestQuantized.test_slow"]
    assert stopped.splitlines()[-1] == "test_slow: unfinished"  # and the summary goes on
    assert summary.splitlines() == [
        "test_ok: OK (0 FAIL lines)",
        "test_subfail: FAILED (failures=1) (1 FAIL lines)",
        "test_slow: OK (0 FAIL lines)",
    ]


def test_the_prs_tests_come_first(tmp_path: Path) -> None:
    test_file = tmp_path / "test_quantized.py"
    test_file.write_text(
        "class TestQuantized:\n    def test_a(self):\n        def test_nested(): pass\n"
        "    def test_qmv_small_batch_matches_single_vector(self): pass\n"
        "    def test_b(self): pass\n"
    )
    got = _bash(tmp_path / "work", tmp_path, f"test_names {test_file}\n")
    assert got.returncode == 0, got.stderr
    assert [n.split(".")[-1] for n in got.stdout.split()] == [
        "test_qmv_small_batch_matches_single_vector",
        "test_a",
        "test_b",
    ]


def test_tests_names_the_tests_a_lease_runs(tmp_path: Path) -> None:
    """TESTS keeps the named tests (short names) in the pipeline's order; unset keeps all."""
    names = "".join(f"test_quantized.TestQuantized.{t}\n" for t in ("test_a", "test_qmm", "test_b"))
    script = f"printf '{names}' | tests_chosen\n"
    every = _bash(tmp_path / "work", tmp_path, script)
    assert every.returncode == 0, every.stderr
    assert every.stdout == names
    chosen = _bash(tmp_path / "work", tmp_path, "TESTS='test_b test_qmm'\n" + script)
    assert [n.split(".")[-1] for n in chosen.stdout.split()] == ["test_qmm", "test_b"]
    # A short name is matched whole: test_qm is none of them.
    assert _bash(tmp_path / "work", tmp_path, "TESTS=test_qm\n" + script).stdout == ""


def test_tests_that_did_not_pass_run_again_on_stock(tmp_path: Path) -> None:
    """A test that failed on the patched build runs on the stock wheel (its own folder on
    PYTHONPATH, python3), read from that batch's logs only; a passing one runs only when
    STOCK_TESTS names it; a second call runs nothing twice."""
    work = tmp_path / "work"
    stock = tmp_path / "stock-site"
    stock.mkdir()
    (stock / "which_mlx.py").write_text("NAME = 'stock'\n")
    _test_file(
        work,
        """\
        import unittest
        class TestQuantized(unittest.TestCase):
            def test_ok(self):
                pass
            def test_stock_only(self):  # passes where the stock folder is importable
                import which_mlx
                self.assertEqual(which_mlx.NAME, "stock")
        """,
    )
    names = " ".join(f"test_quantized.TestQuantized.{t}" for t in ("test_ok", "test_stock_only"))
    script = (
        f"printf '%s\\n' {names} > $WORK/test-names\n"
        'tests_run first "$WORK/test-names"\n'
        'tests_summary "$WORK/test-names" > "$WORK/tests.txt"; cat "$WORK/tests.txt"; echo ---\n'
        f'STOCK_TESTS=test_ok stock_tests {stock} "$WORK/tests.txt"\n'
        'cat "$WORK/stock-tests.txt"; echo ---\n'
        'tests_summary "$WORK/test-names"; echo ---\n'
        f'STOCK_TESTS=test_ok stock_tests {stock} "$WORK/tests.txt"; cat "$WORK/stock-test-names"\n'
    )
    got = _bash(work, tmp_path, script)
    assert got.returncode == 0, got.stderr
    patched, stock_lines, again, ran = got.stdout.split("---\n")
    assert patched.splitlines() == [
        "test_ok: OK (0 FAIL lines)",
        "test_stock_only: FAILED (errors=1) (0 FAIL lines)",
    ]
    assert stock_lines.splitlines() == [  # test_ok only because STOCK_TESTS names it
        "stock test_ok: OK (0 FAIL lines)",
        "stock test_stock_only: OK (0 FAIL lines)",
    ]
    assert again == patched  # the stock batch never stands in for the patched build's verdict
    assert sorted(ran.split()) == [
        "test_quantized.TestQuantized.test_ok",
        "test_quantized.TestQuantized.test_stock_only",
    ]  # each once


def test_parity_that_finds_differences_is_recorded_not_fatal(tmp_path: Path) -> None:
    """Parity's exit 1 (rows differ) or a timeout is written to its .rc; the pipeline goes on."""
    work = tmp_path / "work"
    venv_bin = work / "cache" / "builds" / "cuda-t" / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text("#!/bin/sh\necho 'rows differ'\nexit 1\n")
    (venv_bin / "python").chmod(0o755)
    got = _bash(work, tmp_path, 'parity_default\necho "went on"\n')
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "went on"
    assert (work / "parity-default.rc").read_text().strip() == "1"


def test_the_record_takes_the_tests_after_the_stock_ones_end() -> None:
    """The build record's tests entry carries the stock wheel's verdicts (tests.on_stock), so
    it is written once the stock tests have ended, on either way out of the pipeline."""
    text = SCRIPT.read_text()
    body = text[text.index("\npipeline() {") :]
    body = body[: body.index("\n}\n")]
    last = body.rindex("tests_into_record")
    assert body.rindex('wait "$stock_pid"') < body.rindex('stock_tests "$stock" "$WORK/tests.txt"')
    assert body.rindex('stock_tests "$stock" "$WORK/tests.txt"') < last
    no_wheel = body[body.index("no stock wheel after") :]
    assert no_wheel.index("tests_wait_and_rerun") < no_wheel.index("tests_into_record")
    rerun = text[text.index("tests_wait_and_rerun() {") :]
    assert "cuda_tests_record.py" not in rerun[: rerun.index("\n}\n")]


def test_a_sharded_test_runs_each_point_of_its_grid_once(tmp_path: Path) -> None:
    """SHARDS splits a test into N processes (name@IofN) that run every point of its outer
    ``product`` grid exactly once between them, and each point of a nested ``product`` in
    each; a test SHARDS does not name stays whole. Control: unsharded, one process runs the
    whole grid."""
    work = tmp_path / "work"
    _test_file(
        work,
        """\
        import os, unittest
        from itertools import product
        class TestQuantized(unittest.TestCase):
            def test_grid(self):
                with open(os.environ["POINTS"], "a") as out:
                    for a, b in product([1, 2, 3], [10, 20]):
                        for c, in product([7, 8]):
                            with self.subTest(a=a, b=b, c=c):
                                out.write(f"{a} {b} {c}\\n")
            def test_other(self):
                pass
        """,
    )
    script = (
        "printf '%s\\n' test_quantized.TestQuantized.test_grid "
        "test_quantized.TestQuantized.test_other | tests_sharded > $WORK/names\n"
        'cat $WORK/names; echo ---\ntests_run first "$WORK/names"\ntests_summary "$WORK/names"\n'
    )
    whole = {f"{a} {b} {c}" for a in (1, 2, 3) for b in (10, 20) for c in (7, 8)}
    for shards, expect in ((3, 3), (None, 1)):
        points = tmp_path / f"points-{shards}"
        env = f"export POINTS={points}\n" + (f"SHARDS='test_grid={shards}'\n" if shards else "")
        got = _bash(work, tmp_path, env + script)
        assert got.returncode == 0, got.stderr
        names, summary = got.stdout.split("---\n")
        grid = [n for n in names.split() if "test_grid" in n]
        assert len(grid) == expect
        assert all(line.endswith("OK (0 FAIL lines)") for line in summary.splitlines())
        ran = points.read_text().splitlines()
        assert sorted(ran) == sorted(whole)  # every point once, none twice
    assert names.split()[-1] == "test_quantized.TestQuantized.test_other"


def test_a_bad_shard_is_one_line_error(tmp_path: Path) -> None:
    got = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "mlx_test_shard.py"), "m.C.t@3of2"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert got.returncode != 0
    assert got.stderr.strip() == "mlx_test_shard.py: bad shard '3of2' in 'm.C.t@3of2' (want @IofN)"


def test_a_stopped_stock_test_runs_once_more_never_a_third_time(tmp_path: Path) -> None:
    """With STOCK_EARLY a stock test may be stopped by the timing; the next stock_tests call
    runs it again, and a test that never ends (here: over TEST_LIMIT each time) runs at most
    twice. A test that ended is not run again (the other test's control)."""
    work = tmp_path / "work"
    stock = tmp_path / "stock-site"
    stock.mkdir()
    _test_file(
        work,
        """\
        import time, unittest
        class TestQuantized(unittest.TestCase):
            def test_quick(self):
                pass
            def test_endless(self):
                time.sleep(30)
        """,
    )
    call = (
        f"STOCK_TEST_LIMIT=2 STOCK_TESTS='test_quick test_endless' stock_tests {stock} /dev/null\n"
    )
    got = _bash(work, tmp_path, call * 3 + 'cat "$WORK/stock-test-runs"; echo ---\n'
                'cat "$WORK/stock-tests.txt"\n')  # fmt: skip
    assert got.returncode == 0, got.stderr
    runs, summary = got.stdout.split("---\n")
    assert sorted(runs.split()) == [
        "test_quantized.TestQuantized.test_endless",
        "test_quantized.TestQuantized.test_endless",
        "test_quantized.TestQuantized.test_quick",
    ]
    assert summary.splitlines() == [
        "stock test_endless: unfinished",
        "stock test_quick: OK (0 FAIL lines)",
    ]
