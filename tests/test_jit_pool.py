"""The pool of compiled kernels that test processes with their own JIT caches share."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from patchkit.util import jit_pool

ROOT = Path(__file__).resolve().parent.parent


def _module(folder: Path, name: str, ptx: str = "ptx", txt: bool = True) -> Path:
    """A module as MLX writes it: ``.ptx``, ``.txt``, ``.cu``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.ptx").write_text(ptx)
    if txt:
        (folder / f"{name}.txt").write_text(f"kernel\t_Z{name}")
    (folder / f"{name}.cu").write_text("// source")
    return folder / f"{name}.ptx"


def test_publish_then_seed_hands_whole_modules_on(tmp_path: Path) -> None:
    pool, first, second = tmp_path / "pool", tmp_path / "first", tmp_path / "second"
    _module(first, "qmm_a.b", "A")
    _module(first / "long" / "name", "qmm_c", "C")  # MLX nests folders for long names
    assert jit_pool.publish(first, pool) == 2
    assert jit_pool.publish(first, pool) == 0  # already there: nothing replaced
    _module(second, "qmm_a.b", "mine")  # the process's own file is kept
    assert jit_pool.seed(pool, second) == 1
    assert (second / "qmm_a.b.ptx").read_text() == "mine"
    assert (second / "long" / "name" / "qmm_c.ptx").read_text() == "C"
    assert (second / "long" / "name" / "qmm_c.txt").read_text() == "kernel\t_Zqmm_c"
    assert not list(tmp_path.rglob("*.part"))  # no rename left half-done


def test_count_is_every_module_a_run_starts_with_once(tmp_path: Path) -> None:
    root = tmp_path / "ptx"
    assert jit_pool.count(root, "_shared", "test_") == 0  # nothing yet: a cold start
    _module(root / "_shared", "qmm_a")
    _module(root / "_shared" / "long" / "name", "qmm_b")
    (root / "_shared" / "gemm.txt").write_text("a companion without its .ptx")
    assert jit_pool.count(root, "_shared", "test_") == 2
    # A method stopped at a deadline keeps its folder: its own modules count, shared ones once.
    _module(root / "test_qmm.1", "qmm_a")
    _module(root / "test_qmm.1", "qmm_c")
    assert jit_pool.count(root, "_shared", "test_") == 3
    # Control: modules outside the pool and the methods' folders (parity's, at the root's
    # top or nested there) are no process's start.
    _module(root, "qmm_d")
    _module(root / "other", "qmm_e")
    assert jit_pool.count(root, "_shared", "test_") == 3


def test_a_seeded_module_is_a_link_not_a_copy(tmp_path: Path) -> None:
    pool, folder = tmp_path / "pool", tmp_path / "folder"
    ptx = _module(pool, "qmm")
    jit_pool.seed(pool, folder)
    assert os.path.samefile(ptx, folder / "qmm.ptx")


def test_drop_torn_removes_the_last_module_and_those_without_txt(tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    older = _module(folder, "older")
    no_txt = _module(folder, "no_txt", txt=False)
    os.utime(no_txt, ns=(1, 1))  # oldest, but lacks its kernel names
    last = _module(folder, "last")
    os.utime(last, ns=(3, 3))
    os.utime(older, ns=(2, 2))
    assert jit_pool.drop_torn(folder) == sorted([no_txt, last])
    assert sorted(p.name for p in folder.iterdir()) == ["older.cu", "older.ptx", "older.txt"]
    assert jit_pool.drop_torn(tmp_path / "none") == []


MODULE = """
import os, signal, unittest
from pathlib import Path

class TestJit(unittest.TestCase):
    def test_a_compiles(self):
        cache = Path(os.environ["MLX_PTX_CACHE_DIR"])
        (cache / "kernel.txt").write_text("k\\t_Zk")
        (cache / "kernel.ptx").write_text("compiled once")

    def test_b_dies_writing(self):
        cache = Path(os.environ["MLX_PTX_CACHE_DIR"])
        (cache / "torn.txt").write_text("k\\t_Zt")
        (cache / "torn.ptx").write_text("half")
        os.kill(os.getpid(), signal.SIGKILL)

    def test_c_finds_it(self):
        cache = Path(os.environ["MLX_PTX_CACHE_DIR"])
        self.assertEqual((cache / "kernel.ptx").read_text(), "compiled once")
        self.assertFalse((cache / "torn.ptx").exists())
"""


def test_a_later_process_starts_with_what_an_ended_one_compiled(tmp_path: Path) -> None:
    """One job at a time: ``test_a`` compiles and ends, ``test_b`` is killed in a write,
    ``test_c`` starts with ``test_a``'s kernel and without ``test_b``'s."""
    (tmp_path / "test_jit.py").write_text(textwrap.dedent(MODULE))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, "-m", "patchkit.util.split_unittest", "test_jit", "--jobs", "1",
         "--cache-root", str(tmp_path / "ptx")],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    out = done.stdout
    assert "== test_jit.TestJit.test_a_compiles: ok" in out, out + done.stderr
    assert "== test_jit.TestJit.test_c_finds_it: ok" in out, out
    assert "test_b_dies_writing" in out and "signal 9" in out, out
    pool = tmp_path / "ptx" / "_shared"
    assert (pool / "kernel.ptx").read_text() == "compiled once"
    assert not (pool / "torn.ptx").exists()
    assert not (tmp_path / "ptx" / "test_b_dies_writing" / "torn.ptx").exists()
