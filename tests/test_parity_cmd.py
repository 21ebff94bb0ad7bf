"""`patchkit parity`: routing rules, the CPU run, JSON == printed table, and a negative control."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from patchkit.cli import main
from patchkit.errors import UserError
from patchkit.verify import mlx_parity

METAL_G15 = mlx_parity.DeviceInfo("metal", "applegpu_g15s", 15, "s")
METAL_G13 = mlx_parity.DeviceInfo("metal", "applegpu_g13g", 13, "g")
CUDA = mlx_parity.DeviceInfo("cuda", "NVIDIA H200", cc_major=9)


def cfg(mode: str = "affine", bits: int = 4, B: int = 1, K: int = 4096, N: int = 4096):
    return mlx_parity.Config(mode, bits, 64 if mode == "affine" else 32, "float16", K, N, B)


def test_metal_arch_parses_like_device_cpp() -> None:
    assert mlx_parity.metal_arch("applegpu_g15s") == (15, "s")
    assert mlx_parity.metal_arch("applegpu_g13d") == (13, "d")
    assert mlx_parity.metal_arch("x") == (0, "x")


@pytest.mark.parametrize(
    ("dev", "K", "N", "limit"),
    [
        (METAL_G15, 4096, 4096, 15),  # gen 15 mid table
        (METAL_G15, 8192, 28672, 13),
        (mlx_parity.DeviceInfo("metal", "applegpu_g17s", 17, "s"), 1024, 1024, 33),
        (METAL_G13, 8192, 8192, 6),  # M1 hosted runner, large shape
        (mlx_parity.DeviceInfo("metal", "applegpu_g14d", 14, "d"), 2048, 2048, 32),
        (CUDA, 512, 64, 17),  # CUDA: the patched qmv's M <= 16
        (mlx_parity.DeviceInfo("cpu", "cpu"), 512, 64, 13),  # CPU: a gen-15 Mac's range
    ],
)
def test_batch_limit_matches_get_qmv_batch_limit(dev, K: int, N: int, limit: int) -> None:
    assert mlx_parity.batch_limit(K, N, dev) == limit


def test_kernel_path_routing_rules() -> None:
    # gen >= 15 affine M >= 2: qmv_wide (the defect); M = 1: qmv_fast when aligned.
    assert mlx_parity.kernel_path(METAL_G15, cfg(), 2) == "qmv_wide"
    assert mlx_parity.kernel_path(METAL_G15, cfg(), 1) == "qmv_fast"
    # gen 13 affine: per-vector qmv at every M below the limit; qmv on ragged shapes.
    assert mlx_parity.kernel_path(METAL_G13, cfg(), 5) == "qmv_fast"
    assert mlx_parity.kernel_path(METAL_G13, cfg(K=640, N=37), 3) == "qmv"
    # fp modes take fp_qmv_wide on every generation.
    assert mlx_parity.kernel_path(METAL_G13, cfg("mxfp4"), 2) == "fp_qmv_wide"
    # M >= limit: qmm (split-K when B == 1).
    assert mlx_parity.kernel_path(METAL_G13, cfg(K=8192, N=8192), 6) == "qmm_splitk"
    assert mlx_parity.kernel_path(METAL_G15, cfg(B=3), 15) == "qmm"
    # CUDA: M * B < 8 -> qmv, else qmm.
    assert mlx_parity.kernel_path(CUDA, cfg(B=3), 2) == "qmv"
    assert mlx_parity.kernel_path(CUDA, cfg(B=3), 3) == "qmm"
    assert mlx_parity.kernel_path(mlx_parity.DeviceInfo("cpu", "cpu"), cfg(), 4) == "cpu"


def test_shared_weights_fold_into_m_on_metal_only() -> None:
    """Metal's dispatch folds a batch over one weight matrix into M; the compared M stop
    where the folded M reaches the batch limit. CUDA keeps M and B apart."""
    shared = mlx_parity.Config("affine", 4, 64, "float16", 512, 64, 3, shared_w=True)
    assert mlx_parity.folded(METAL_G15, shared, 4) == (12, 1)
    assert mlx_parity.folded(CUDA, shared, 4) == (4, 3)
    limit = mlx_parity.batch_limit(512, 64, METAL_G15)
    stop = mlx_parity.m_stop(METAL_G15, shared, limit)
    assert (stop - 1) * 3 < limit <= stop * 3
    assert mlx_parity.kernel_path(METAL_G15, shared, stop - 1) == "qmv_wide"
    assert mlx_parity.kernel_path(METAL_G15, shared, stop) == "qmm_splitk"
    # CUDA: M * B <= 16 on the tensor cores (4-bit float16), M * B < 8 elsewhere.
    assert mlx_parity.m_stop(CUDA, shared, 17) == 6
    f32 = mlx_parity.Config("affine", 4, 64, "float32", 512, 64, 1)
    assert mlx_parity.m_stop(CUDA, f32, 17) == 8


def test_patched_cuda_paths_follow_the_tensor_core_routing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A patched CUDA build runs M * B <= 16 on qmv's tensor cores (qmv_mma) for 4- and
    8-bit weights with float16/bfloat16 activations; every other qmv call keeps upstream's
    kernel, one vector per block (qmv). The overlay's switches: MLX_CUDA_QMV_EXACT=1 keeps
    qmm's M <= 16 in qmv where the tensor cores do not apply, MLX_CUDA_QMV_SHARED_WEIGHTS=0
    turns the tensor-core path off."""
    monkeypatch.delenv("MLX_CUDA_QMV_EXACT", raising=False)
    monkeypatch.delenv("MLX_CUDA_QMV_SHARED_WEIGHTS", raising=False)

    def path(m: int, **kw: Any) -> str:
        return mlx_parity.kernel_path(CUDA, cfg(**{"bits": 8, **kw}), m, patched=True)

    assert [path(m) for m in (1, 2, 8, 16, 17)] == ["qmv_mma"] * 4 + ["qmm"]
    assert path(2, bits=4) == "qmv_mma"
    assert path(2, bits=6) == "qmv"
    assert path(5, B=3) == "qmv_mma" and path(6, B=3) == "qmm"
    f32 = mlx_parity.Config("affine", 8, 64, "float32", 4096, 4096, 1)
    assert mlx_parity.kernel_path(CUDA, f32, 2, patched=True) == "qmv"
    assert mlx_parity.kernel_path(CUDA, cfg("mxfp8"), 2, patched=True) == "qmv_mma"
    # Unpatched, the same calls are stock's qmv and qmm.
    assert mlx_parity.kernel_path(CUDA, cfg(bits=8), 2) == "qmv"
    assert mlx_parity.kernel_path(CUDA, cfg(bits=8), 8) == "qmm"
    monkeypatch.setenv("MLX_CUDA_QMV_EXACT", "1")
    assert mlx_parity.kernel_path(CUDA, f32, 9, patched=True) == "qmv"
    assert path(9) == "qmv_mma" and path(17) == "qmm"
    monkeypatch.setenv("MLX_CUDA_QMV_SHARED_WEIGHTS", "0")
    assert path(2) == "qmv" and path(9) == "qmv"
    # Read as MLX reads it (atoi): leading digits count, no digits is 0.
    for value, on in (("1", True), (" 2x", True), ("junk", False), ("", False)):
        monkeypatch.setenv("MLX_CUDA_QMV_SHARED_WEIGHTS", value)
        assert (path(2) == "qmv_mma") == on, value


def test_configs_quick_covers_axes_and_filters() -> None:
    quick = mlx_parity.configs(False)
    assert {c.bits for c in quick if c.mode == "affine"} == set(mlx_parity.AFFINE_BITS)
    assert {c.group_size for c in quick if c.mode == "affine"} == set(mlx_parity.GROUP_SIZES)
    assert {c.mode for c in quick} == {"affine", *mlx_parity.FP_MODES}
    assert {c.B for c in quick} == set(mlx_parity.BATCHES)
    shared = [c for c in quick if c.shared_w]  # broadcast weights, every affine bits
    assert {c.bits for c in shared} == set(mlx_parity.AFFINE_BITS) and all(c.B > 1 for c in shared)
    assert len(mlx_parity.configs(True)) > len(quick)
    only = mlx_parity.configs(False, modes=["affine"], bits=[3], dtypes=["bfloat16"])
    assert only and all((c.mode, c.bits, c.dtype) == ("affine", 3, "bfloat16") for c in only)


@pytest.mark.parametrize(("backend", "identical", "ended"), [
    ("cuda", True, 0), ("cuda", False, 1),
    ("cpu", False, None),  # control: elsewhere the usual exit, teardown and all
])  # fmt: skip
def test_cli_parity_on_cuda_ends_without_teardown(
    monkeypatch: pytest.MonkeyPatch, backend: str, identical: bool, ended: int | None
) -> None:
    """``patchkit parity`` on CUDA ends once its verdict is printed, skipping the teardown
    that can abort there (exit -6 for a verdict of 0 or 1)."""
    report = {"device": {"backend": backend}, "identical": identical}
    monkeypatch.setattr(mlx_parity, "run", lambda cfgs, progress: report)
    monkeypatch.setattr(mlx_parity, "format_report", lambda r: "the table")
    calls: list[int] = []

    def end(code: int) -> None:
        calls.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(mlx_parity, "exit_without_teardown", end)
    done = CliRunner().invoke(main, ["parity"])
    assert "the table" in done.output
    assert calls == ([] if ended is None else [ended])
    assert done.exit_code == (0 if identical else 1)


mlx = pytest.importorskip("mlx.core", reason="mlx not importable: pip install -e '.[mlx]'")


def test_cli_json_matches_printed_table(tmp_path: Path) -> None:
    args = ["parity", "--mode", "affine", "--bits", "4", "--bits", "3", "--dtype", "bfloat16"]
    runner = CliRunner()
    human = runner.invoke(main, args)
    out = tmp_path / "mlx_parity.json"
    machine = runner.invoke(main, [*args, "--json", "--out", str(out)])
    assert human.exit_code == 0, human.output
    assert machine.exit_code == 0, machine.output
    report = json.loads(machine.stdout)
    assert json.loads(out.read_text()) == report
    assert report["device"]["backend"] == "cpu"
    assert report["rows_compared"] > 0 and report["rows_differing"] == 0
    assert report["rows_differing_by_mode"] == {"affine": 0}
    assert set(report["rows_differing_by_path"].values()) == {0}
    table = mlx_parity.parse_table(human.stdout)
    assert table == [mlx_parity.table_cells(r) for r in report["rows"]]
    # bits {3, 4} x B {1, 3}, and the five 4-bit bfloat16 GPU-only layers (three shapes,
    # and batched and broadcast weights; skipped on the CPU)
    assert len(table) == 9
    # every M from 2 to limit - 1, each with the dispatch path named
    assert [m["M"] for m in report["rows"][0]["by_m"]] == list(range(2, report["rows"][0]["limit"]))
    verdict, scope = human.stdout.splitlines()[-2:]
    assert "0/" in verdict and "identical" in verdict
    # It says what it tested: on the CPU backend, neither the patch nor a GPU path.
    assert scope == report["scope"] and "CPU backend" in scope and "neither" in scope


class _ReorderedMLX:
    """mlx.core whose batched quantized_matmul sums K in two halves, then adds them.

    The negative control: a batched path that is not the M = 1 kernel must be caught.
    """

    def __init__(self, mx: Any):
        self._mx = mx

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mx, name)

    def quantized_matmul(self, x, w, scales, biases, **kw: Any) -> Any:
        mx = self._mx
        if x.shape[-2] == 1:
            return mx.quantized_matmul(x, w, scales, biases, **kw)
        gs, bits = kw["group_size"], kw["bits"]
        wt = mx.swapaxes(mx.dequantize(w, scales, biases, group_size=gs, bits=bits), -1, -2)
        h = x.shape[-1] // 2
        return x[..., :h] @ wt[..., :h, :] + x[..., h:] @ wt[..., h:, :]


def test_negative_control_reordered_batch_is_caught() -> None:
    dev = mlx_parity.DeviceInfo("cpu", "cpu")
    c = mlx_parity.Config("affine", 4, 64, "float32", 512, 64, 1)
    row = mlx_parity.run_config(_ReorderedMLX(mlx), dev, c)
    assert row["status"] == "ok"
    assert row["rows_differing"] > 0 and row["max_abs_diff"] > 0
    assert mlx_parity.run_config(mlx, dev, c)["rows_differing"] == 0
    # The report names the path the differing rows took (here every M runs the CPU's one path).
    cpu_path = {m["path"] for m in row["by_m"]}
    assert mlx_parity.by_path([row]) == {cpu_path.pop(): row["rows_differing"]}


def test_unsupported_mode_is_reported_not_raised() -> None:
    c = mlx_parity.Config("mxfp4", 4, 64, "float16", 512, 64, 1)  # mxfp4 admits only gs 32
    row = mlx_parity.run_config(mlx, mlx_parity.DeviceInfo("cpu", "cpu"), c)
    assert row["status"] == "unsupported" and row["error"]
    assert mlx_parity.table_cells(row)[-1].startswith("unsupported")


def test_large_shapes_run_the_tensor_cores_and_skip_on_cpu() -> None:
    """Both matrices carry GPU-only layers of at least 2**23 weights, 4- and 8-bit, in both
    16-bit dtypes, so that parity on a patched CUDA build runs the tensor-core qmv at every
    M <= 16 at sizes read from HBM (batched and broadcast weights included); on the CPU
    backend they are reported as skipped, not run. The small affine configurations in a
    16-bit dtype reach the same kernel."""
    large = [c for c in mlx_parity.configs(full=True) if c.gpu_only]
    assert {(c.K, c.N) for c in large} == set(mlx_parity.LARGE_SHAPES.values())
    assert {(c.B, c.shared_w) for c in large} == {(1, False), (3, False), (3, True)}
    assert {c.dtype for c in large} == {"bfloat16", "float16"}
    assert {c.bits for c in large} == {4, 8}
    assert [c for c in mlx_parity.configs(full=False) if c.gpu_only] == large
    assert min(k * n for k, n in mlx_parity.LARGE_SHAPES.values()) == 1 << 23
    for c in large:
        for m in range(1, 16 // c.B + 1):
            assert mlx_parity.kernel_path(CUDA, c, m, patched=True) == "qmv_mma", (c, m)
    small = [c for c in mlx_parity.configs(full=True) if not c.gpu_only and c.mode == "affine"]
    reach = {
        mlx_parity.kernel_path(CUDA, c, m, patched=True)
        for c, m in itertools.product(small, range(2, 6))
        if c.dtype != "float32" and c.bits in (4, 8)
    }
    assert reach == {"qmv_mma"}
    ragged = mlx_parity.LARGE_SHAPES["ragged"]
    assert ragged[0] % 512 and ragged[1] % 8  # a K tail and a partial last row block
    row = mlx_parity.run_config(mlx, mlx_parity.DeviceInfo("cpu", "cpu"), large[0])
    assert (row["status"], row["rows"]) == ("skipped", 0)
    assert mlx_parity.table_cells(row)[-1] == "skipped: GPU only (large shape)"


def test_the_module_run_narrows_like_patchkit_parity(tmp_path: Path, monkeypatch) -> None:
    """``python -m patchkit.verify.mlx_parity --mode/--bits/--dtype`` runs only the
    configurations those keep (a run under compute-sanitizer needs few); none left is
    a one-line error."""
    seen: list[list[mlx_parity.Config]] = []

    def fake_run(cfgs, progress=None, seed=0, patched=False):
        seen.append(cfgs)
        if not cfgs:
            raise UserError("no configuration left after the --mode/--bits/--dtype filters")
        return {"identical": True, "rows": [], "scope": ""}

    monkeypatch.setattr(mlx_parity, "run", fake_run)
    monkeypatch.setattr(mlx_parity, "format_report", lambda report: "")
    out = tmp_path / "p.json"
    argv = ["--out", str(out), "--dtype", "bfloat16", "--bits", "4", "--bits", "8"]
    assert mlx_parity.main(argv) == 0
    assert seen[0] and {(c.dtype, c.bits) for c in seen[0]} <= {("bfloat16", 4), ("bfloat16", 8)}
    assert any(c.gpu_only for c in seen[0])  # the large layers stay in
    assert mlx_parity.main(["--out", str(out)]) == 0
    assert len(seen[1]) > len(seen[0])  # control: unnarrowed, more
    assert mlx_parity.main(["--out", str(out), "--mode", "nonesuch"]) == 2


@pytest.mark.parametrize(("ending", "teardown_ran"), [
    ("runpy.run_module('patchkit.verify.mlx_parity', run_name='__main__')", False),
    # control: the usual exit runs the teardown
    ("sys.exit(__import__('patchkit.verify.mlx_parity').verify.mlx_parity.main())", True),
])  # fmt: skip
def test_parity_ends_without_the_teardown_that_can_abort(
    tmp_path: Path, ending: str, teardown_ran: bool
) -> None:
    """``python -m patchkit.verify.mlx_parity`` keeps its exit code (2 here: nothing left
    to compare) where the teardown would abort (MLX's CUDA backend at driver unload)."""
    import subprocess
    import sys

    program = (
        "import atexit, os, runpy, sys\n"
        "atexit.register(lambda: (print('teardown', flush=True), os.abort()))\n"
        f"sys.argv = ['mlx_parity', '--out', {str(tmp_path / 'p.json')!r}, '--mode', 'none']\n"
        f"{ending}\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1], check=False)  # fmt: skip
    assert "no configuration left" in done.stderr
    assert ("teardown" in done.stdout) is teardown_ran
    assert done.returncode == (-6 if teardown_ran else 2)
