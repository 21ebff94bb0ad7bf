"""CUDA harness: the streamed qmv through ``mx.fast.cuda_kernel`` on stock MLX wheels.

Two halves with a file between them, because the GPU host has no MLX clone:

* ``build_bundle`` (here, with the pinned ``qmv.cu`` text) writes one header:
  an NVRTC preamble, upstream's ``dequant_fma`` and ``qmv_kernel_impl`` taken
  from the pinned text by structure, a ``__device__`` copy of ``qmv_kernel``
  derived from it (the M = 1 sanity arm), and the streamed kernel rendered from
  ``templates/.../qmv.cu/streamed_kernel.cu.j2`` with the patch's own context.
  One header per x-staging variant (``RenderOptions.cuda_x_staging``: the
  default ``global``, and ``smem``), so one run can time both side by side.
  The bundle is written under a git-ignored folder and never committed, since
  it holds MLX source.
* ``run_config`` (on the GPU host, MLX imported lazily) compiles per-instance
  kernel bodies against that header, checks every row bit for bit against
  MLX's compiled ``quantized_matmul(x[i:i+1])``, and times the arms.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, astuple, dataclass
from pathlib import Path
from typing import Any

from patchkit.carry import cxx, render

QMV_PATH = "mlx/backend/cuda/quantized/qmm/qmv.cu"
KERNEL_TEMPLATE = "streamed_kernel.cu.j2"
# MLX's cp.async helpers and the sm_80 macro they test, in include order.
STEEL_HEADERS = ("mlx/backend/cuda/steel/defines.cuh", "mlx/backend/cuda/steel/utils.cuh")
# One JIT header per RenderOptions.cuda_x_staging value; the default keeps its old name.
HEADER_NAMES = {"global": "qmv_jit_header.cuh", "smem": "qmv_jit_header_smem.cuh"}
HEADER_NAME = HEADER_NAMES["global"]
ROWS_PER_BLOCK = 8
WARP = 32
H200_COPY_BW = 4.3e12  # bytes/s, device-to-device copy measured on this workplace's H200s

# Under NVRTC the default cuda_kernel header has already pulled in libcu++'s
# <cuda/std/limits>, which defines FP_NAN & co.; cutlass's NVRTC fallback header
# defines them again and fails. MLX's own JIT'd qmm_sm90 header undefines them
# the same way; cutlass also wants a few std:: names NVRTC has no STL for.
NVRTC_PREAMBLE = """\
#if defined(__CUDACC_RTC__)
#include <cuda/cmath>
#include <cuda/std/type_traits>
namespace std {
using cuda::std::is_pointer_v;
using cuda::std::max;
using cuda::std::void_t;
} // namespace std
#undef FP_NAN
#undef FP_INFINITE
#undef FP_ZERO
#undef FP_SUBNORMAL
#undef FP_NORMAL
#endif
#include "mlx/backend/cuda/device/cute_dequant.cuh"
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
"""

# The M = 1 kernel, as a device function the cuda_kernel body can call.
M1_DERIVE = render.Derive(
    function="qmv_kernel",
    name="qmv_kernel_jit",
    rename="qmv_kernel_jit",
    replace=((r"__global__", "__device__ __forceinline__"),),
)


@dataclass(frozen=True)
class Config:
    """One problem: weights N x K quantized to ``bits`` with ``group_size``, in ``dtype``."""

    K: int
    N: int
    bits: int
    group_size: int
    dtype: str  # "bfloat16" | "float16"

    @property
    def cxx_type(self) -> str:
        return {"bfloat16": "cutlass::bfloat16_t", "float16": "cutlass::half_t"}[self.dtype]

    @property
    def cxx_quant(self) -> str:
        return {4: "cutlass::uint4b_t", 8: "uint8_t"}[self.bits]

    @property
    def elems_per_thread(self) -> int:
        """qmv's choice: 16 for 16-bit T with at most 4-bit Q, else 8."""
        return 16 if self.bits <= 4 else 8

    @property
    def has_residue_k(self) -> bool:
        return self.K % (WARP * self.elems_per_thread) != 0

    @property
    def tag(self) -> str:
        return f"{self.dtype}_b{self.bits}_g{self.group_size}_r{int(self.has_residue_k)}"


def _qmv_plan() -> render.FilePlan:
    for plan in render.load_plans():
        if plan.path == QMV_PATH:
            return plan
    raise FileNotFoundError(f"no template plan for {QMV_PATH}")


def streamed_kernel_text(qmv_source: str, options: render.RenderOptions | None = None) -> str:
    """The streamed kernel snippet exactly as the patch inserts it into ``qmv.cu``.

    The context is built the way ``render.render_file`` builds it: the plan's
    derivations from the same upstream text, plus the options.
    """
    options = options or render.RenderOptions()
    plan = _qmv_plan()
    derived = {d.name: render.derive(qmv_source, d) for d in plan.derives}
    return render.render_snippet(plan, KERNEL_TEMPLATE, render.context(options, derived))


def steel_headers(read: Callable[[str], str]) -> str:
    """MLX's ``steel/defines.cuh`` and ``steel/utils.cuh`` (cp.async helpers) as one text.

    The smem kernel calls ``cp_async`` & co. and tests ``MLX_CUDA_SM_80_ENABLED``;
    MLX's JIT embeds only ``device/*.cuh``, so the bundle carries these two
    inline: ``#pragma once`` and the include of the first from the second dropped.
    """
    texts = []
    for path in STEEL_HEADERS:
        lines = read(path).splitlines(keepends=True)
        drop = ("#pragma once", *(f'#include "{h}"' for h in STEEL_HEADERS))
        texts.append("".join(line for line in lines if line.strip() not in drop))
    return "\n".join(texts)


def jit_header(
    qmv_source: str,
    options: render.RenderOptions | None = None,
    read: Callable[[str], str] | None = None,
) -> str:
    """The cuda_kernel header: upstream helpers by structure, plus the rendered snippet.

    ``read`` (a pinned-file reader) supplies MLX's steel headers, which the smem
    render includes; a ValueError says so when it is missing.
    """
    options = options or render.RenderOptions()
    upstream = [f.text(qmv_source) for f in cxx.find_functions(qmv_source, "dequant_fma")]
    upstream.append(cxx.function_text(qmv_source, "qmv_kernel_impl"))
    upstream.append(render.derive(qmv_source, M1_DERIVE))
    steel = []
    if options.cuda_x_staging == "smem":
        if read is None:
            raise ValueError("the smem JIT header inlines MLX's steel/*.cuh: pass read")
        steel = [steel_headers(read)]
    parts = [
        NVRTC_PREAMBLE,
        *steel,
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n",
        *upstream,
        streamed_kernel_text(qmv_source, options),
        "} // namespace mlx::core::cu\n",
    ]
    return "\n".join(parts)


def build_bundle(
    qmv_source: str,
    out_dir: Path,
    options: render.RenderOptions | None = None,
    read: Callable[[str], str] | None = None,
) -> Path:
    """Write the JIT header for the GPU host; returns its path (write-if-different).

    The file name says the variant (``HEADER_NAMES[options.cuda_x_staging]``);
    ``read`` is :func:`jit_header`'s.
    """
    options = options or render.RenderOptions()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / HEADER_NAMES[options.cuda_x_staging]
    text = jit_header(qmv_source, options, read)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def _casts(cfg: Config) -> str:
    return (
        f"  using T = {cfg.cxx_type};\n  using Q = {cfg.cxx_quant};\n  using S = T;\n"
        "  auto* x_ = reinterpret_cast<const T*>(x);\n"
        "  auto* w_ = reinterpret_cast<const Q*>(w);\n"
        "  auto* s_ = reinterpret_cast<const S*>(scales);\n"
        "  auto* b_ = reinterpret_cast<const T*>(biases);\n"
        "  auto* o_ = reinterpret_cast<T*>(out);\n"
    )


def m1_body(cfg: Config) -> str:
    """Body calling the derived copy of upstream's M = 1 ``qmv_kernel`` (grid.y = M)."""
    residue = str(cfg.has_residue_k).lower()
    targs = f"{ROWS_PER_BLOCK}, {cfg.elems_per_thread}, {cfg.group_size}, true, {residue}"
    return _casts(cfg) + (
        f"  qmv_kernel_jit<{targs}, T, Q, S>(\n"
        "      x_, w_, s_, b_, nullptr, o_, params[1], params[2], false);\n"
    )


@dataclass(frozen=True)
class Knobs:
    """The smem kernel body's trailing template parameters; each default is the body's own.

    None of them changes any row's arithmetic: they say how x is staged, how many rows
    a warp owns and how the weights are fetched. The global header's body has none.
    """

    stage_steps: int = 4  # max_stage_steps: k steps per staged x copy
    rows_per_warp: int = 1  # rows one warp owns (its x slices are read once for them)
    l2_prefetch: bool = False  # ask L2 for the warp's weight rows up front
    x_async: bool = False  # double-buffered cp.async x staging

    def template_args(self) -> list[str]:
        """The trailing template arguments, without trailing defaults (as a caller writes)."""
        args = [str(v).lower() for v in astuple(self)]
        defaults = [str(v).lower() for v in astuple(Knobs())]
        while args and args[-1] == defaults[len(args) - 1]:
            args.pop()
        return args

    def name_suffix(self) -> str:
        """What a kernel name adds for the non-default knobs (``_s1``, ``_w2``, ``_pf``, ...)."""
        return (
            ("" if self.stage_steps == 4 else f"_s{self.stage_steps}")
            + ("" if self.rows_per_warp == 1 else f"_w{self.rows_per_warp}")
            + ("_pf" if self.l2_prefetch else "")
            + ("_async" if self.x_async else "")
        )


# What the patch's __global__ qmv_streamed_kernel passes from sm_80 on (with 8 rows per
# block, V in {2, 4}); below sm_80 it stages one k step at a time, without cp.async.
SHIPPED_KNOBS = Knobs(rows_per_warp=2, l2_prefetch=True, x_async=True)


def streamed_body(
    cfg: Config, vecs: int, rows_per_block: int = ROWS_PER_BLOCK, knobs: Knobs = Knobs()
) -> str:
    """Body calling the rendered streamed kernel body with V = ``vecs``; M read from params.

    The same body serves either header: the x-staging variant is in the header's text.
    Non-default ``knobs`` need the smem header.
    """
    targs = (
        f"{vecs}, {rows_per_block}, {cfg.elems_per_thread}, {cfg.group_size}, true, "
        f"{str(cfg.has_residue_k).lower()}"
    )
    qsargs = ", ".join(["T, Q, S", *knobs.template_args()])
    return _casts(cfg) + (
        f"  qmv_streamed_kernel_body<{targs}, {qsargs}>(\n"
        "      x_, w_, s_, b_, nullptr, o_, params[0], params[1], params[2], false);\n"
    )


def pick_vecs(m: int, vecs: Sequence[int]) -> int:
    """The launcher's rule: the smallest V holding all of M, else the largest V (M tiles)."""
    for v in sorted(vecs):
        if m <= v:
            return v
    return max(vecs)


def m1_grid(cfg: Config, m: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """cuda_kernel grid (in threads) and block for qmv's (ceil(N/8), M, 1) x (32, 8) launch."""
    blocks_x = math.ceil(cfg.N / ROWS_PER_BLOCK)
    return (WARP * blocks_x, ROWS_PER_BLOCK * m, 1), (WARP, ROWS_PER_BLOCK, 1)


def streamed_grid(
    cfg: Config, m: int, vecs: int, rows_per_block: int = ROWS_PER_BLOCK, rows_per_warp: int = 1
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Grid (in threads) and block of the streamed launch: row blocks x M tiles in x.

    A block has ``rows_per_block / rows_per_warp`` warps.
    """
    blocks_x = math.ceil(cfg.N / rows_per_block) * math.ceil(m / vecs)
    warps = rows_per_block // rows_per_warp
    return (WARP * blocks_x, warps, 1), (WARP, warps, 1)


@dataclass(frozen=True)
class Arm:
    """One streamed arm: its V set, the x-staging variant it was rendered with, rows per block."""

    vecs: tuple[int, ...]
    variant: str = "global"  # RenderOptions.cuda_x_staging
    rows_per_block: int = ROWS_PER_BLOCK
    knobs: Knobs = Knobs()  # smem only


def as_arm(spec: Arm | Sequence[int]) -> Arm:
    """A bare V set is the default arm (x from global memory, 8 rows per block)."""
    return spec if isinstance(spec, Arm) else Arm(tuple(spec))


# mx.fast.cuda_kernel's default header at the pin (custom_kernel.cpp), which it puts
# before the user header; an nvcc check of the bundle starts the same way.
CUDA_KERNEL_DEFAULT_HEADER = """\
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>
"""


Instance = tuple[Config, int, int, Knobs]  # (config, V, rows_per_block, knobs)


def nvcc_source(header: str, instances: Sequence[Instance]) -> str:
    """A .cu that wraps streamed bodies the way cuda_kernel does, for ``nvcc -Xptxas -v``.

    Each instance becomes a ``__global__`` named ``streamed_<tag>_v<V>_r<rows><knobs>``
    (``Knobs.name_suffix``). Not NVRTC (the device run covers that), but the same header
    text and the same bodies, so ptxas's register and shared memory counts are the ones
    the JIT arms get.
    """
    kernels = []
    for cfg, vecs, rows, knobs in instances:
        kernels.append(
            f"__global__ void streamed_{cfg.tag}_v{vecs}_r{rows}{knobs.name_suffix()}(\n"
            "    const uint16_t* x, const uint8_t* w, const uint16_t* scales,\n"
            "    const uint16_t* biases, const int32_t* params, uint16_t* out) {\n"
            f"{streamed_body(cfg, vecs, rows, knobs)}}}\n"
        )
    return "\n".join(
        [
            CUDA_KERNEL_DEFAULT_HEADER,
            header,
            "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n",
            *kernels,
            "} // namespace mlx::core::cu\n",
        ]
    )


def ptxas_usage(log: str) -> dict[str, dict[str, int]]:
    """Per ``__global__`` in ``nvcc -Xptxas -v`` output: registers, shared bytes, spill bytes."""
    usage: dict[str, dict[str, int]] = {}
    name = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name = m.group(1)
            usage[name] = {"registers": 0, "smem": 0, "spill": 0}
            continue
        if name is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            usage[name]["spill"] = int(m.group(1)) + int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            usage[name]["registers"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            usage[name]["smem"] = int(s.group(1)) if s else 0
    return usage


def weight_bytes(cfg: Config) -> int:
    """Bytes of packed weights plus scales and biases one pass must read."""
    packed = cfg.N * cfg.K * cfg.bits // 8
    groups = cfg.N * (cfg.K // cfg.group_size)
    return packed + 2 * groups * 2  # scales + biases, 16-bit each


# --------------------------------------------------------------------------
# GPU half: everything below imports mlx lazily.
# --------------------------------------------------------------------------


def _mx() -> Any:
    import mlx.core as mx  # lazy: the CPU half must not need MLX

    return mx


class Kernels:
    """Compiled cuda_kernel objects, one per (arm, config, V), built from one header.

    ``variant`` is the header's ``cuda_x_staging``; it goes into every kernel name,
    because MLX caches cuda_kernel objects by name across headers.
    """

    def __init__(self, header: str, variant: str = "global"):
        self.header = header
        self.variant = variant
        self._cache: dict[str, Any] = {}

    def get(self, name: str, body: str) -> Any:
        """A cuda_kernel for ``body``; ``name`` must be unique per body (MLX caches by name)."""
        if name not in self._cache:
            self._cache[name] = _mx().fast.cuda_kernel(
                name=name,
                input_names=["x", "w", "scales", "biases", "params"],
                output_names=["out"],
                source=body,
                header=self.header,
            )
        return self._cache[name]


@dataclass
class Problem:
    """Quantized weights (possibly several copies, to defeat L2) and 16 input vectors.

    ``rows``, ``prefixes`` and the JIT kernels' ``params`` (M, N, K per M) are built
    and evaluated once, so timed loops launch only the kernels under test.
    """

    cfg: Config
    weights: list[tuple[Any, Any, Any]]
    x: Any
    rows: list[Any]
    prefixes: list[Any]
    params: list[Any]

    def qmm(self, xx: Any, copy: int = 0) -> Any:
        """MLX's compiled quantized_matmul (the stock routing decides the kernel)."""
        wq, s, b = self.weights[copy]
        c = self.cfg
        return _mx().quantized_matmul(
            xx, wq, s, b, transpose=True, group_size=c.group_size, bits=c.bits
        )


def make_problem(cfg: Config, seed: int, min_bytes: int = 0, max_m: int = 16) -> Problem:
    """Random weights and vectors; enough weight copies to exceed ``min_bytes`` in total."""
    mx = _mx()
    dtype = getattr(mx, cfg.dtype)
    mx.random.seed(seed)
    copies = max(1, min(8, math.ceil(min_bytes / weight_bytes(cfg)))) if min_bytes else 1
    weights = []
    for _ in range(copies):
        w = mx.random.normal((cfg.N, cfg.K)).astype(dtype)
        weights.append(tuple(mx.quantize(w, group_size=cfg.group_size, bits=cfg.bits)))
    x = (mx.random.normal((max_m, cfg.K)) * 0.5).astype(dtype)
    rows = [mx.contiguous(x[i : i + 1]) for i in range(max_m)]
    prefixes = [mx.contiguous(x[:m]) for m in range(max_m + 1)]
    params = [mx.array([m, cfg.N, cfg.K], dtype=mx.int32) for m in range(max_m + 1)]
    mx.eval(weights, x, rows, prefixes, params)
    return Problem(cfg, weights, x, rows, prefixes, params)


KernelSet = Kernels | Mapping[str, Kernels]


def _by_variant(kernels: KernelSet) -> Mapping[str, Kernels]:
    return {kernels.variant: kernels} if isinstance(kernels, Kernels) else kernels


def _base(kernels: Mapping[str, Kernels]) -> Kernels:
    """The header the M = 1 copy runs from (the default one when present; all hold it)."""
    return kernels.get("global") or next(iter(kernels.values()))


def run_arm(
    kernels: Mapping[str, Kernels],
    prob: Problem,
    m: int,
    arm: Arm,
    copy: int = 0,
    fill: bool = True,
) -> tuple[int, Any]:
    """(V, output) of one streamed arm on x[:m], from the header of the arm's variant."""
    v = pick_vecs(m, arm.vecs)
    return v, run_jit(kernels[arm.variant], prob, m, v, copy, arm.rows_per_block, arm.knobs, fill)


def kernel_name(
    variant: str, cfg: Config, vecs: int, rows_per_block: int, knobs: Knobs = Knobs()
) -> str:
    """The cuda_kernel name of a streamed instance; the default arm keeps its old name."""
    if variant == "global" and rows_per_block == ROWS_PER_BLOCK and knobs == Knobs():
        return f"qmv_streamed_v{vecs}_{cfg.tag}"
    return f"qmv_streamed_{variant}_v{vecs}_r{rows_per_block}{knobs.name_suffix()}_{cfg.tag}"


def run_jit(
    kernels: Kernels,
    prob: Problem,
    m: int,
    vecs: int | None,
    copy: int = 0,
    rows_per_block: int = ROWS_PER_BLOCK,
    knobs: Knobs = Knobs(),
    fill: bool = True,
) -> Any:
    """Launch the M = 1 copy (``vecs`` None, grid.y = M) or the streamed kernel on x[:m].

    ``fill`` pre-fills the output with NaN, so an element the kernel never writes fails
    the bitwise check; parity needs it, timing does not (it would time a fill kernel too).
    """
    cfg = prob.cfg
    if vecs is None:
        suffix = cfg.tag if kernels.variant == "global" else f"{kernels.variant}_{cfg.tag}"
        kern = kernels.get(f"qmv_m1_{suffix}", m1_body(cfg))
        grid, block = m1_grid(cfg, m)
    else:
        name = kernel_name(kernels.variant, cfg, vecs, rows_per_block, knobs)
        kern = kernels.get(name, streamed_body(cfg, vecs, rows_per_block, knobs))
        grid, block = streamed_grid(cfg, m, vecs, rows_per_block, knobs.rows_per_warp)
    wq, s, b = prob.weights[copy]
    return kern(
        inputs=[prob.prefixes[m], wq, s, b, prob.params[m]],
        output_shapes=[(m, cfg.N)],
        output_dtypes=[prob.x.dtype],
        grid=grid,
        threadgroup=block,
        init_value=float("nan") if fill else None,
    )[0]


def _bits(arr: Any) -> Any:
    """The array's 16-bit patterns as numpy, for bitwise comparison (NaN-safe)."""
    import numpy as np

    mx = _mx()
    return np.array(arr.view(mx.uint16))


def rows_differing(got: Any, singles: Any) -> int:
    """How many rows of ``got`` differ in any bit from the M = 1 rows ``singles``."""
    g = _bits(got)
    return int(sum(not (g[i] == singles[i]).all() for i in range(g.shape[0])))


def max_abs_diff(got: Any, singles_f32: Any) -> float:
    """Largest absolute difference to the M = 1 rows, in float32 (NaN shows as NaN)."""
    import numpy as np

    g = np.array(got.astype(_mx().float32))
    return float(np.max(np.abs(g - singles_f32[: g.shape[0]])))


def parity(
    kernels: KernelSet, prob: Problem, vec_sets: Mapping[str, Arm | Sequence[int]]
) -> dict[str, Any]:
    """Bitwise verdicts for every M: JIT M = 1 copy, streamed arms, and MLX batched (control)."""
    import numpy as np

    mx = _mx()
    ks = _by_variant(kernels)
    max_m = len(prob.rows)
    singles = [prob.qmm(r) for r in prob.rows]
    mx.eval(singles)
    ref = np.concatenate([_bits(s) for s in singles])
    ref_f32 = np.concatenate([np.array(s.astype(mx.float32)) for s in singles])
    out: dict[str, Any] = {"jit_m1_copy": {}, "batched_control": {}}
    for m in range(1, max_m + 1):
        y = run_jit(_base(ks), prob, m, None)
        out["jit_m1_copy"][m] = rows_differing(y, ref)
        yb = prob.qmm(prob.prefixes[m])
        out["batched_control"][m] = [rows_differing(yb, ref), max_abs_diff(yb, ref_f32)]
    for label, spec in vec_sets.items():
        arm: dict[int, Any] = {}
        for m in range(1, max_m + 1):
            v, y = run_arm(ks, prob, m, as_arm(spec))
            arm[m] = [v, rows_differing(y, ref), max_abs_diff(y, ref_f32)]
        out[f"streamed_{label}"] = arm
    return out


def gpu_time(fn: Callable[[int], Any], iters: int, repeats: int = 3, warm: int = 3) -> float:
    """Seconds per call: ``iters`` calls queued, one eval, one sync; median of ``repeats``.

    Queuing many calls before one synchronisation keeps the GPU busy back to back,
    so the host's per-call encoding overlaps kernels instead of adding to them.
    """
    mx = _mx()
    for i in range(warm):
        mx.eval(fn(i))
    mx.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([fn(i) for i in range(iters)])
        mx.synchronize()
        samples.append((time.perf_counter() - t0) / iters)
    return sorted(samples)[len(samples) // 2]


def timing(
    kernels: KernelSet,
    prob: Problem,
    vec_sets: Mapping[str, Arm | Sequence[int]],
    ms: Sequence[int],
    iters: int,
) -> dict[int, Any]:
    """Per M: streamed (per arm), M separate M = 1 calls, MLX batched, JIT qmv copy (us)."""
    ks = _by_variant(kernels)
    copies = len(prob.weights)
    wb = weight_bytes(prob.cfg)
    res: dict[int, Any] = {}
    for m in ms:
        row: dict[str, Any] = {}
        for label, spec in vec_sets.items():
            arm = as_arm(spec)
            v = pick_vecs(m, arm.vecs)
            t = gpu_time(lambda i, m=m, a=arm: run_arm(ks, prob, m, a, i % copies, False)[1], iters)
            row[f"streamed_{label}_V"] = v
            row[f"streamed_{label}_us"] = t * 1e6
            row[f"streamed_{label}_bw_frac"] = wb / t / H200_COPY_BW
        t_c = gpu_time(lambda i, m=m: [prob.qmm(prob.rows[j], i % copies) for j in range(m)], iters)
        t_b = gpu_time(lambda i, m=m: prob.qmm(prob.prefixes[m], i % copies), iters)
        t_j = gpu_time(
            lambda i, m=m: run_jit(_base(ks), prob, m, None, i % copies, fill=False), iters
        )
        row.update(
            separate_m1_us=t_c * 1e6,
            batched_us=t_b * 1e6,
            batched_bw_frac=wb / t_b / H200_COPY_BW,
            jit_qmv_copy_us=t_j * 1e6,
        )
        res[m] = row
    return res


def run_config(
    kernels: KernelSet,
    cfg: Config,
    vec_sets: Mapping[str, Arm | Sequence[int]],
    timing_sets: Mapping[str, Arm | Sequence[int]] | None,
    ms: Sequence[int] = tuple(range(1, 17)),
    iters: int = 30,
) -> dict[str, Any]:
    """Parity for every arm, then (if ``timing_sets``) the timing sweep, for one config.

    ``kernels`` maps variant -> Kernels (a single Kernels is the default variant);
    an arm is a bare V set (x from global memory) or an :class:`Arm`.
    """
    t0 = time.perf_counter()
    min_bytes = 256 << 20 if timing_sets else 0  # several copies: timed passes miss in L2
    prob = make_problem(cfg, seed=cfg.K + cfg.N + cfg.bits, min_bytes=min_bytes)
    result: dict[str, Any] = {
        "config": asdict(cfg),
        "weight_bytes": weight_bytes(cfg),
        "weight_copies": len(prob.weights),
        "parity": parity(kernels, prob, vec_sets),
    }
    if timing_sets:
        result["timing_sets"] = {
            k: asdict(v) if isinstance(v, Arm) else list(v) for k, v in timing_sets.items()
        }
        result["timing"] = timing(kernels, prob, timing_sets, ms, iters)
    result["seconds"] = time.perf_counter() - t0
    return result


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    """One line per config: is every streamed row exact, did the control differ?"""
    p = result["parity"]
    arms = {k: arm for k, arm in p.items() if k.startswith("streamed_")}
    streamed = {k: sum(r[1] for r in arm.values()) for k, arm in arms.items()}
    control = p["batched_control"]
    return {
        "jit_m1_copy_rows_differing": sum(p["jit_m1_copy"].values()),
        "streamed_rows_differing": streamed,
        "control_rows_differing_m_ge_8": sum(v[0] for m, v in control.items() if int(m) >= 8),
    }


def dump(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON atomically enough for a run that may be cut off: temp file, then rename."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)
