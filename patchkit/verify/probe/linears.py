"""The quantized linear the probe's model calls: MLX's own, or the streamed kernel.

``stock`` is ``mx.quantized_matmul`` and so whatever MLX routes M rows to (qmv,
qmv_wide, qmm...). ``streamed`` keeps M = 1 on that same stock call and sends
M >= 2 rows to the order-preserving streamed kernel, compiled at run time from
the other harnesses' text: on NVIDIA through ``mx.fast.cuda_kernel`` with
:mod:`patchkit.verify.harness.cuda`'s header and bodies, on Apple GPUs through
``mx.fast.metal_kernel`` with :mod:`patchkit.verify.harness.metal`. That is the routing
the patch gives MLX (M = 1 unchanged), so a streamed block is compared with the
very chain a patched MLX would run. There is no streamed kernel for MLX's CPU
backend; :func:`availability` says so instead of faking an arm.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from patchkit.errors import UserError
from patchkit.verify import dispatch
from patchkit.verify.probe.model import Linear, QWeight

ARMS = ("stock", "streamed")
# Negative control: proves the byte comparison can fail on any host (see :func:`reordered`).
CONTROL = "reordered"
ALL_ARMS = (*ARMS, CONTROL)


def _mx() -> Any:
    import mlx.core as mx

    return mx


def backend() -> str:
    """``cuda``, ``metal`` or ``cpu``: where MLX's default device computes."""
    mx = _mx()
    if mx.default_device() == mx.cpu:
        return "cpu"
    if mx.metal.is_available():
        return "metal"
    return "cuda" if mx.cuda.is_available() else "cpu"


def availability(cuda_header: Path | None) -> dict[str, str | None]:
    """Per arm: None when it can run here, else the reason it cannot."""
    where = backend()
    reason: str | None = None
    if where == "cpu":
        reason = (
            "no streamed kernel on MLX's CPU backend (it exists for NVIDIA via "
            "mx.fast.cuda_kernel and Apple GPUs via mx.fast.metal_kernel); stock only"
        )
    elif where == "cuda" and (cuda_header is None or not cuda_header.is_file()):
        reason = (
            f"CUDA JIT header not found ({cuda_header}); build it with "
            "scripts/cuda_jit_bundle.py and pass --cuda-header"
        )
    return {"stock": None, "streamed": reason, CONTROL: None}


def stock() -> Linear:
    """MLX's ``quantized_matmul`` (transposed weights): MLX picks the kernel by M."""
    mx = _mx()

    def lin(x: Any, w: QWeight) -> Any:
        return mx.quantized_matmul(
            x, w.wq, w.scales, w.biases, transpose=True, group_size=w.group_size, bits=w.bits
        )

    return lin


def reordered() -> Linear:
    """M = 1 stock; M >= 2 as dequantize-then-matmul, a different summation order.

    Not a kernel anyone ships: the negative control. Where stock MLX happens to be
    row-exact (its CPU backend), this arm shows the probe still catches an order change.
    """
    mx = _mx()
    one = stock()

    def lin(x: Any, w: QWeight) -> Any:
        if x.shape[0] == 1:
            return one(x, w)
        dense = mx.dequantize(w.wq, w.scales, w.biases, group_size=w.group_size, bits=w.bits)
        return x @ dense.T

    return lin


class CudaStreamed:
    """M >= 2 through the streamed kernel via ``mx.fast.cuda_kernel``; M = 1 stays stock."""

    def __init__(self, header: str, vecs: Sequence[int]):
        from patchkit.verify.harness import cuda

        self.cuda = cuda
        self.kernels = cuda.Kernels(header)
        self.vecs = tuple(vecs)
        self.stock = stock()

    def __call__(self, x: Any, w: QWeight) -> Any:
        m = x.shape[0]
        if m == 1:
            return self.stock(x, w)
        mx, cuda = _mx(), self.cuda
        cfg = cuda.Config(w.in_dim, w.out_dim, w.bits, w.group_size, str(x.dtype).split(".")[-1])
        v = cuda.pick_vecs(m, self.vecs)
        # The name holds every template argument of the body (tag + V); K, N, M are runtime.
        kern = self.kernels.get(f"probe_qmv_streamed_v{v}_{cfg.tag}", cuda.streamed_body(cfg, v))
        grid, block = cuda.streamed_grid(cfg, m, v)
        params = mx.array([m, w.out_dim, w.in_dim], dtype=mx.int32)
        return kern(
            inputs=[mx.contiguous(x), w.wq, w.scales, w.biases, params],
            output_shapes=[(m, w.out_dim)],
            output_dtypes=[x.dtype],
            grid=grid,
            threadgroup=block,
            init_value=float("nan"),  # an unwritten element then shows as a difference
        )[0]


class MetalStreamed:
    """M >= 2 through the streamed kernel via ``mx.fast.metal_kernel``; M = 1 stays stock.

    V per call follows the patched host's tiling (:func:`dispatch.vecs_per_tg`).
    """

    def __init__(self, root: Path):
        from patchkit.verify.harness import metal

        self.metal = metal
        src = metal.metal_source(root)
        self.kernels = {f: metal.make_kernel(_mx(), src, f) for f in (True, False)}
        self.stock = stock()

    def __call__(self, x: Any, w: QWeight) -> Any:
        m = x.shape[0]
        if m == 1:
            return self.stock(x, w)
        v = dispatch.vecs_per_tg(m)
        kern = self.kernels[self.metal.is_fast(w.in_dim, w.out_dim, w.bits)]
        return self.metal.run_streamed(
            _mx(), kern, w.wq, w.scales, w.biases, _mx().contiguous(x), w.group_size, w.bits, v
        )


def make(arm: str, root: Path, cuda_header: Path | None, vecs: Sequence[int]) -> Linear:
    """The linear for ``arm``; UserError when that arm cannot run on this host."""
    why = availability(cuda_header).get(arm, f"unknown arm {arm!r}; choose from {ALL_ARMS}")
    if why:
        raise UserError(f"arm {arm!r} unavailable: {why}")
    if arm == "stock":
        return stock()
    if arm == CONTROL:
        return reordered()
    if backend() == "cuda":
        assert cuda_header is not None
        return CudaStreamed(cuda_header.read_text(), vecs)
    return MetalStreamed(root)
