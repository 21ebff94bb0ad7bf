"""`patchkit parity`: bitwise row identity of the importable MLX, batched vs M = 1.

For each configuration it runs ``mx.quantized_matmul`` once per vector (M = 1,
the reference every decoding step produces) and once per M = 2 ... limit - 1
on the same vectors, and compares every row bit for bit (float32 as uint32,
half types as uint16). Each M also runs with its operands produced and its output
compared inside one lazy graph, with new and with recycled buffers: a primitive
whose launches do not wait for their inputs, or whose readers do not wait for
every launch, differs there although a call on evaluated arrays passes. Whatever
MLX is importable is measured: a stock wheel, or the build ``patchkit build`` made.
It also names the kernel path MLX's dispatch takes for each shape on this device
(:func:`kernel_path`), because the verdict means different things on different paths.

MLX is imported lazily so the rest of patchkit works without it.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from patchkit.errors import UserError
from patchkit.verify import dispatch
from patchkit.verify.dispatch import (
    AFFINE_BITS,
    FP_MODES,
    GROUP_SIZES,
    DeviceInfo,
    batch_limit,
    metal_arch,
)

DTYPES = ("float32", "float16", "bfloat16")
BATCHES = (1, 3)
# (K, N) with why each is here, kept small because MLX's CPU backend is slow
# (~10 ms per row at 1024 x 256). "aligned" takes qmv_fast at M = 1 for every
# bits (K % qmv_fast_k_alignment == 0, N % 8 == 0); "ragged" takes qmv with its
# safe tail (640 % 512 != 0) and moved-back last tile (37 = 4 * 8 + 5).
SHAPES = {"aligned": (512, 64), "ragged": (640, 37)}
# GPU only (minutes on MLX's CPU backend), in either matrix: layers of realistic size
# (N * K >= 2**23) on the patched CUDA qmv's tensor cores, 4- and 8-bit, in both 16-bit
# dtypes; "ragged" has N % 8 != 0 and a K that ends in a partial step (4160 is 32.5 of the
# kernel's 128-weight steps at 4 bits, and not a multiple of stock qmv's 512); "wide" has
# N >= 8192, where the kernel takes 4 warps over K instead of 8, with N % 16 != 0 and 9
# steps of K at 4 bits (uneven over the 4 warps). The small shapes above reach the same
# kernel; these check it at the sizes where it reads from HBM.
LARGE_SHAPES = {"floor": (4096, 2048), "ragged": (4160, 4100), "wide": (1152, 8200)}
# Lazy-graph runs per M on a GPU, each with new buffers and each with recycled ones
# (:meth:`_Operands.rows_differing_in_graph`).
GRAPH_REPEATS = 3
LARGE_BITS = (4, 8)  # the widths the patched CUDA qmv runs on tensor cores


@dataclass(frozen=True)
class Config:
    """One parity configuration: a weight matrix, a dtype and a batch count."""

    mode: str
    bits: int
    group_size: int
    dtype: str
    K: int
    N: int
    B: int
    # B > 1 with one weight matrix for every batch: MLX broadcasts it (the
    # ``broadcast_w`` case of CUDA's qmv, batch strides of 0 on Metal).
    shared_w: bool = False
    # Run on a GPU backend only (LARGE_SHAPES); reported as skipped on the CPU backend.
    gpu_only: bool = False

    def label(self) -> str:
        shared = " shared-w" if self.shared_w else ""
        return (
            f"{self.mode} b{self.bits} g{self.group_size} {self.dtype} "
            f"K{self.K} N{self.N} B{self.B}{shared}"
        )


def detect_device(mx: Any) -> DeviceInfo:
    """The default device of the imported MLX, with its Metal architecture when there is one."""
    if mx.metal.is_available():
        arch = str(mx.metal.device_info().get("architecture", ""))
        gen, size = metal_arch(arch)
        return DeviceInfo("metal", arch, gen, size)
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        info = mx.device_info() if hasattr(mx, "device_info") else {}
        cc_major = int(info.get("compute_capability_major", 0))
        return DeviceInfo("cuda", str(info.get("device_name", "cuda")), cc_major=cc_major)
    return DeviceInfo("cpu", "cpu")


def kernel_path(dev: DeviceInfo, cfg: Config, M: int, patched: bool = False) -> str:
    """The kernel MLX's dispatch picks for ``cfg`` at ``M`` rows (:mod:`dispatch`).

    Nothing in Python tells a patched build from a stock one, so the caller
    says which it imported: ``patchkit build`` passes ``patched`` for the MLX it
    built from ``patches/``; otherwise the path is stock's.
    """
    M, B = folded(dev, cfg, M)
    args = (dev, cfg.mode, cfg.bits, cfg.K, cfg.N, M, B)
    if not patched:
        return dispatch.kernel_path(*args, group_size=cfg.group_size)
    return dispatch.patched_kernel_path(
        *args,
        cuda_exact=cuda_exact_enabled(),
        group_size=cfg.group_size,
        dtype=cfg.dtype,
        cuda_shared_weights=cuda_shared_weights_enabled(),
    )


def folded(dev: DeviceInfo, cfg: Config, M: int) -> tuple[int, int]:
    """(M, B) as the backend's dispatch sees them.

    Metal folds a batch of inputs over one 2-D weight matrix into M
    (``non_batched``: M = x.size() / K, B = 1); CUDA keeps M = x.shape(-2).
    """
    if cfg.shared_w and dev.backend == "metal":
        return M * cfg.B, 1
    return M, cfg.B


def m_stop(dev: DeviceInfo, cfg: Config, limit: int) -> int:
    """One past the largest M compared: the folded M (:func:`folded`) stays below the batch
    limit, so on Metal every call stays on the vector kernels whose order is the claim.

    On CUDA, M * B stays in the range a patched build claims: up to 16 where qmv runs on
    tensor cores (or the overlay's exact route is on), stock's qmv range (M * B < 8)
    elsewhere. Past it runs stock's qmm, in another order by design, and each of its
    kernels is compiled at run time first (tens of seconds each)."""
    if dev.backend == "cuda":
        wide = cuda_exact_enabled() or dispatch.cuda_qmv_mma(
            dev, cfg.mode, cfg.bits, cfg.dtype, cfg.K, cuda_shared_weights_enabled()
        )
        rows = dispatch.CUDA_QMV_MMA_MAX_ROWS if wide else dispatch.CUDA_QMV_MAX_ROWS - 1
        return min(limit, rows // cfg.B + 1)
    per_m = folded(dev, cfg, 1)[0]  # how many dispatch rows one M makes
    return (limit - 1) // per_m + 1


def _env_int(name: str, default: int) -> int:
    """An integer variable read as MLX's ``env::get_var(name, default)`` reads it: ``atoi``
    of the value when set (leading digits, 0 when there are none), else ``default``."""
    value = os.environ.get(name)
    if value is None:
        return default
    digits = re.match(r"\s*([+-]?\d+)", value)
    return int(digits.group(1)) if digits else 0


def cuda_exact_enabled() -> bool:
    """Whether ``MLX_CUDA_QMV_EXACT`` asks a patched CUDA build (overlay) for the exact
    M <= 16 route: default 0, non-zero is on."""
    return _env_int("MLX_CUDA_QMV_EXACT", 0) != 0


def cuda_shared_weights_enabled() -> bool:
    """Whether a patched CUDA build (overlay) reads weights once for several vectors:
    ``MLX_CUDA_QMV_SHARED_WEIGHTS``, default 1; 0 keeps one vector per block."""
    return _env_int("MLX_CUDA_QMV_SHARED_WEIGHTS", 1) != 0


def configs(
    full: bool,
    modes: Iterable[str] = (),
    bits: Iterable[int] = (),
    dtypes: Iterable[str] = (),
) -> list[Config]:
    """The matrix, optionally narrowed by mode, bits and dtype (empty = all).

    ``full`` is every axis; the quick default keeps every bits, dtype and B on
    one shape and group size 64, plus the other group sizes on 4-bit float16.
    """
    keep = _keep(set(modes), set(bits), set(dtypes))
    return [c for c in _all_configs(full) if keep(c)]


def _keep(modes: set[str], bits: set[int], dtypes: set[str]) -> Callable[[Config], bool]:
    return lambda c: (
        (not modes or c.mode in modes)
        and (not bits or c.bits in bits)
        and (not dtypes or c.dtype in dtypes)
    )


def _all_configs(full: bool) -> list[Config]:
    """Every configuration of the quick or full matrix."""
    shapes = list(SHAPES.values()) if full else [SHAPES["aligned"]]
    gs_all = GROUP_SIZES if full else (64,)
    out = [
        Config("affine", bits, gs, dtype, K, N, B)
        for (K, N), bits, gs, dtype, B in itertools.product(
            shapes,  # M = 1 path: qmv_fast / qmv
            AFFINE_BITS,  # affine bits
            gs_all,  # group sizes
            DTYPES,  # activation / output dtypes
            BATCHES,  # batch count (batched weights when B > 1)
        )
    ]
    if not full:  # the other group sizes on the most used bits
        out += [Config("affine", 4, gs, "float16", *shapes[0], 1) for gs in (32, 128)]
    # One weight matrix for a batch of inputs (broadcast weights), every affine bits.
    out += [
        Config("affine", bits, 64, "float16", K, N, BATCHES[-1], shared_w=True)
        for (K, N), bits in itertools.product(shapes, AFFINE_BITS)
    ]
    # Quick and full: skipped on the CPU backend, seconds on a GPU.
    out += [
        Config("affine", bits, 64, dtype, K, N, 1, gpu_only=True)
        for (K, N), bits, dtype in itertools.product(
            LARGE_SHAPES.values(), LARGE_BITS, ("bfloat16", "float16")
        )
    ]
    # Batched and broadcast weights at a realistic size.
    out += [
        Config("affine", bits, 64, "bfloat16", *LARGE_SHAPES["floor"], BATCHES[-1],
               shared_w=shared, gpu_only=True)
        for bits, shared in itertools.product(LARGE_BITS, (False, True))
    ]  # fmt: skip
    fp_dtypes = DTYPES if full else ("float16",)
    for (mode, (gs, bits)), dtype, B in itertools.product(FP_MODES.items(), fp_dtypes, BATCHES):
        out.append(Config(mode, bits, gs, dtype, *shapes[0], B))
    return out


def _bits(mx: Any, y: Any) -> np.ndarray:
    """The raw bits of ``y`` (float32 as uint32, half types as uint16): exact comparison."""
    view = mx.uint32 if y.dtype == mx.float32 else mx.uint16
    return np.array(y.view(view))


def _path_summary(by_m: list[dict[str, Any]]) -> str:
    """Consecutive M with one path folded: ``2-7:qmv 8-12:qmm``."""
    parts: list[list[Any]] = []
    for r in by_m:
        if parts and parts[-1][2] == r["path"] and parts[-1][1] == r["M"] - 1:
            parts[-1][1] = r["M"]
        else:
            parts.append([r["M"], r["M"], r["path"]])
    return " ".join(f"{a}-{b}:{p}" if a != b else f"{a}:{p}" for a, b, p in parts)


class _Operands:
    """A config's quantized weights and vectors, built once and sliced per M."""

    def __init__(self, mx: Any, cfg: Config, m_max: int, seed: int):
        rng = np.random.default_rng(seed)
        lead = (cfg.B,) if cfg.B > 1 else ()  # B > 1: batched inputs
        w_lead = () if cfg.shared_w else lead  # ... and batched or shared weights
        dtype = getattr(mx, cfg.dtype)
        w = mx.array(rng.standard_normal((*w_lead, cfg.N, cfg.K), dtype=np.float32)).astype(dtype)
        self.mx, self.cfg, self.dtype = mx, cfg, dtype
        self.x = rng.standard_normal((*lead, m_max, cfg.K), dtype=np.float32)
        q = mx.quantize(w, group_size=cfg.group_size, bits=cfg.bits, mode=cfg.mode)
        self.w, self.scales = q[0], q[1]
        self.biases = q[2] if len(q) > 2 else None

    def matmul(self, x: np.ndarray, b: int | None = None) -> Any:
        """``quantized_matmul`` of fresh contiguous ``x`` (with weights ``b`` when given)."""
        mx, c = self.mx, self.cfg
        pick = (lambda a: a) if b is None else (lambda a: None if a is None else a[b])
        y = mx.quantized_matmul(
            mx.array(x).astype(self.dtype),
            pick(self.w),
            pick(self.scales),
            pick(self.biases),
            transpose=True,
            group_size=c.group_size,
            bits=c.bits,
            mode=c.mode,
        )
        mx.eval(y)
        return y

    def rows_differing_in_graph(self, x: np.ndarray, want: np.ndarray, recycle: bool) -> Any:
        """Which rows of ``quantized_matmul(x)`` differ from ``want`` (bits), with the operands
        produced and the output compared in the same lazy graph as the matmul.

        Nothing is evaluated between the producers and the matmul, nor between the matmul and
        the comparison: a launch that does not wait for its inputs, or a reader that does not
        wait for every launch writing the output, reads memory not yet written. ``recycle``
        first leaves a NaN-filled buffer of the output's size in MLX's cache, so a read of
        recycled memory shows as a difference rather than as an earlier call's right answer;
        otherwise the cache is emptied and every buffer is new.
        """
        mx, c = self.mx, self.cfg
        n_out = int(np.prod(want.shape))
        if recycle:
            mx.eval(mx.full((n_out,), float("nan"), self.dtype))
        else:
            mx.clear_cache()
        one = mx.array(1, self.dtype)
        # Multiplying by one (adding zero for packed weights) keeps every bit: a producer
        # kernel per operand, in the graph.
        xs = mx.array(x).astype(self.dtype) * one
        biases = None if self.biases is None else self.biases * mx.array(1, self.biases.dtype)
        scales = self.scales * mx.array(1, self.scales.dtype)
        y = mx.quantized_matmul(
            xs, self.w + 0, scales, biases, transpose=True, group_size=c.group_size,
            bits=c.bits, mode=c.mode,
        )  # fmt: skip
        view = mx.uint32 if y.dtype == mx.float32 else mx.uint16
        differ = mx.any(y.view(view) != mx.array(want.reshape(y.shape)), axis=-1)
        mx.eval(differ)
        return np.array(differ).reshape(want.shape[:-1])

    def _weights_of(self, b: int) -> int | None:
        """Which weights batch ``b`` multiplies: its own, or the shared matrix (None)."""
        return b if self.cfg.B > 1 and not self.cfg.shared_w else None

    def reference(self) -> np.ndarray:
        """Every vector alone (M = 1): bits of shape (B, m_max, N)."""
        xs = self.x.reshape(-1, *self.x.shape[-2:])
        rows = [
            [
                _bits(self.mx, self.matmul(xb[i : i + 1], self._weights_of(b)))[0]
                for i in range(xb.shape[0])
            ]
            for b, xb in enumerate(xs)
        ]
        return np.array(rows)


def run_config(
    mx: Any, dev: DeviceInfo, cfg: Config, seed: int = 0, patched: bool = False
) -> dict[str, Any]:
    """One table row: every M = 2 ... limit - 1 compared with M = 1, bit for bit."""
    limit = batch_limit(cfg.K, cfg.N, dev)
    row: dict[str, Any] = {**asdict(cfg), "limit": limit, "status": "ok", "by_m": []}
    no_rows = {"rows": 0, "rows_differing": 0, "max_abs_diff": 0.0, "paths": ""}
    if cfg.gpu_only and dev.backend == "cpu":
        return {**row, **no_rows, "status": "skipped", "error": "GPU only (large shape)"}
    try:
        ops = _Operands(mx, cfg, limit - 1, seed)
        ref = ops.reference()
    except (ValueError, RuntimeError) as exc:  # MLX raises these for unsupported modes
        return {**row, **no_rows, "status": "unsupported", "error": str(exc).splitlines()[0]}
    repeats = graph_repeats(dev)
    for M in range(2, m_stop(dev, cfg, limit)):
        y = ops.matmul(ops.x[..., :M, :])
        got = _bits(mx, y).reshape(ref.shape[0], M, -1)
        want = ref[:, :M]
        eager_diff = (got != want).any(axis=-1)
        graph_diff = np.zeros_like(eager_diff)
        for recycle in [False] * repeats + [True] * repeats:
            graph_diff |= ops.rows_differing_in_graph(ops.x[..., :M, :], want, recycle)
        diff = eager_diff | graph_diff
        yf = np.array(y.astype(mx.float32)).reshape(got.shape)
        wf = np.array(mx.array(want).view(y.dtype).astype(mx.float32))
        row["by_m"].append(
            {
                "M": M,
                "path": kernel_path(dev, cfg, M, patched),
                "rows": int(diff.size),
                "rows_differing": int(diff.sum()),
                # Of those, the rows that differed only when produced and read lazily.
                "graph_only_differing": int((graph_diff & ~eager_diff).sum()),
                "max_abs_diff": float(np.abs(yf - wf).max()),
            }
        )
    row["rows"] = sum(r["rows"] for r in row["by_m"])
    row["rows_differing"] = sum(r["rows_differing"] for r in row["by_m"])
    row["max_abs_diff"] = max(r["max_abs_diff"] for r in row["by_m"])
    row["paths"] = _path_summary(row["by_m"])
    return row


def graph_repeats(dev: DeviceInfo) -> int:
    """How often each M runs lazily with new buffers, and again with recycled ones.

    A GPU backend can race (launches scheduled as graph nodes), and a race shows only in
    some runs; the CPU backend runs each primitive in order, so once proves the check runs.
    """
    return 1 if dev.backend == "cpu" else GRAPH_REPEATS


def import_mlx() -> Any:
    """``mlx.core``, or a UserError saying how to get it."""
    try:
        import mlx.core as mx
    except ImportError as exc:
        raise UserError(
            "MLX is not importable: pip install 'patchkit[mlx]' (Linux CPU), "
            "'mlx==0.32.1' (macOS), or run `patchkit build` on a patched worktree"
        ) from exc
    return mx


def run(
    cfgs: list[Config],
    progress: Callable[[str], None] | None = None,
    seed: int = 0,
    patched: bool = False,
) -> dict[str, Any]:
    """The whole parity report over ``cfgs`` (the JSON ``patchkit parity`` writes)."""
    mx = import_mlx()
    dev = detect_device(mx)
    if not cfgs:
        raise UserError("no configuration left after the --mode/--bits/--dtype filters")
    rows = []
    for cfg in cfgs:
        if progress:
            progress(cfg.label())
        rows.append(run_config(mx, dev, cfg, seed, patched))
    checked = [r for r in rows if r["status"] == "ok"]
    report = {
        "mlx_version": mx.__version__,
        "mlx": "patched" if patched else "as imported (stock unless built by patchkit)",
        "device": asdict(dev),
        "rows": rows,
        "rows_compared": sum(r["rows"] for r in checked),
        "rows_differing": sum(r["rows_differing"] for r in checked),
        "identical": all(r["rows_differing"] == 0 for r in checked),
        # Per mode, so a failure names the kernel family (affine or an fp mode).
        "rows_differing_by_mode": {
            m: sum(r["rows_differing"] for r in checked if r["mode"] == m)
            for m in dict.fromkeys(r["mode"] for r in checked)
        },
        # Per kernel path, so a failure says whose kernel it is: rows that differ only on
        # stock's qmm are the defect a route left to stock, not the patch's kernels.
        "rows_differing_by_path": by_path(checked),
    }
    return {**report, "scope": scope(report)}


def by_path(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Differing rows per kernel path (:func:`kernel_path`), over every M of ``rows``."""
    out: dict[str, int] = {}
    for r in rows:
        for m in r.get("by_m", []):
            out[m["path"]] = out.get(m["path"], 0) + m["rows_differing"]
    return dict(sorted(out.items()))


TABLE_COLUMNS = (
    "mode",
    "bits",
    "group_size",
    "dtype",
    "K",
    "N",
    "B",
    "shared_w",
    "rows",
    "rows_differing",
    "max_abs_diff",
    "paths",
)


def table_cells(row: dict[str, Any]) -> list[str]:
    """One printed line's cells, derived only from the JSON row (so the two cannot disagree)."""
    cells = [str(row[c]) for c in TABLE_COLUMNS[: TABLE_COLUMNS.index("rows")]]
    if row["status"] != "ok":
        return [*cells, "-", "-", "-", f"{row['status']}: {row['error']}"]
    return [
        *cells,
        str(row["rows"]),
        str(row["rows_differing"]),
        repr(row["max_abs_diff"]),
        row["paths"],
    ]


def scope(report: dict[str, Any]) -> str:
    """What a report tested, in one line: which MLX, which backend, which kernel paths."""
    backend = report["device"]["backend"]
    patched = report.get("mlx") == "patched"
    which = "a patched build" if patched else "MLX as imported (stock unless built by patchkit)"
    paths = sorted({m["path"] for r in report["rows"] for m in r.get("by_m", [])})
    if backend == "cpu":
        return (
            f"tested: {which} on the CPU backend, one code path for every M: "
            "neither the streamed kernels nor a GPU path"
        )
    return f"tested: {which} on {backend}, kernel paths {', '.join(paths) or 'none'}"


def format_report(report: dict[str, Any]) -> str:
    """The human table for ``report`` plus a one-line verdict."""
    dev = report["device"]
    where = dev["name"] + (f" (gen {dev['gen']})" if dev["gen"] else "")
    body = [TABLE_COLUMNS, *(table_cells(r) for r in report["rows"])]
    widths = [max(len(line[i]) for line in body) for i in range(len(TABLE_COLUMNS) - 1)]
    lines = [f"MLX {report['mlx_version']} on {dev['backend']}: {where}"]
    lines += [
        "  ".join([*(c.ljust(w) for c, w in zip(line, widths, strict=False)), line[-1]])
        for line in body
    ]
    verdict = "identical" if report["identical"] else "ROWS DIFFER"
    modes = ", ".join(f"{m} {n}" for m, n in report["rows_differing_by_mode"].items())
    paths = ", ".join(f"{p} {n}" for p, n in report.get("rows_differing_by_path", {}).items())
    lines.append(
        f"{report['rows_differing']}/{report['rows_compared']} rows differ ({modes}; by "
        f"kernel path: {paths or 'none'}): {verdict}"
    )
    lines.append(scope(report))
    return "\n".join(lines)


def parse_table(text: str) -> list[list[str]]:
    """Split a printed table back into cells (the tests compare it with the JSON)."""
    lines = text.splitlines()[2:-2]  # title and column names; verdict and scope
    return [re.split(r"\s{2,}", line.rstrip(), maxsplit=len(TABLE_COLUMNS) - 1) for line in lines]


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` where the user asked (the artifact CI uploads)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m patchkit.verify.mlx_parity``: parity without patchkit's CLI dependencies.

    ``patchkit build`` runs this inside its own virtual environment, which holds
    MLX and numpy but not click or rich.
    """
    import argparse

    ap = argparse.ArgumentParser(prog="python -m patchkit.verify.mlx_parity")
    ap.add_argument("--full", action="store_true", help="the full matrix (default: quick)")
    ap.add_argument("--patched", action="store_true", help="the MLX was built from patches/")
    ap.add_argument("--out", type=Path, required=True, help="JSON report here")
    # Narrowing, as `patchkit parity` does: e.g. a run under compute-sanitizer.
    ap.add_argument("--mode", action="append", default=[], help="only this mode (repeatable)")
    ap.add_argument("--bits", action="append", default=[], type=int, help="only these bits")
    ap.add_argument("--dtype", action="append", default=[], help="only this dtype (repeatable)")
    a = ap.parse_args(argv)
    cfgs = configs(a.full, a.mode, a.bits, a.dtype)
    try:
        report = run(cfgs, lambda m: print(m, flush=True), patched=a.patched)
    except UserError as exc:
        print(f"mlx_parity: {exc}", file=sys.stderr)
        return 2
    write_json(a.out, report)
    print(format_report(report))
    return 0 if report["identical"] else 1


def exit_without_teardown(code: int) -> None:
    """End the process with ``code`` once its output is out, skipping interpreter teardown.

    MLX's CUDA backend can abort after the verdict, while the process tears down: a
    ``CudaHandle`` destructor throws ("driver shutting down") once the CUDA runtime has
    unloaded (ml-explore/mlx#4531, more often when another process shares the GPU). The
    verdict is complete and written by then; the abort would make it read as a crash.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_teardown(main())
