"""The quantized linear the probe's model calls: MLX's own, or the streamed kernel.

``stock`` is ``mx.quantized_matmul`` and so whatever MLX routes M rows to (qmv,
qmv_wide, qmm...). ``streamed`` keeps M = 1 on that same stock call and sends
M >= 2 rows to the order-preserving streamed kernel, compiled at run time from
the Metal harness's text through ``mx.fast.metal_kernel``
(:mod:`patchkit.verify.harness.metal`). That is the routing the patch gives MLX
(M = 1 unchanged), so a streamed block is compared with the very chain a patched
MLX would run.

Only on Apple GPUs. There is no streamed kernel for MLX's CPU backend, and none to
JIT on CUDA: the CUDA change is MLX's own compiled ``qmv`` taking a number of vectors
per block (one body, ``templates/mlx/backend/cuda/``), not a separate kernel whose
text could go through ``mx.fast.cuda_kernel``; the compiled harness
(:mod:`patchkit.verify.harness.cuda`) runs it on torch tensors, outside MLX's graph.
A JIT copy would be a second body that no patched MLX runs, so on CUDA the probe
runs a patched build instead (``patchkit build --backend cuda``), whose ``stock``
arm is the patched routing. :func:`availability` says so instead of faking an arm.
"""

from __future__ import annotations

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


def availability() -> dict[str, str | None]:
    """Per arm: None when it can run here, else the reason it cannot."""
    where = backend()
    reason: str | None = None
    if where == "cpu":
        reason = (
            "no streamed kernel on MLX's CPU backend (it exists for Apple GPUs via "
            "mx.fast.metal_kernel); stock only"
        )
    elif where == "cuda":
        reason = (
            "no streamed arm on CUDA: the change is MLX's own compiled qmv (one body), not "
            "a kernel to JIT; run the probe under a patched build (patchkit build --backend "
            "cuda), whose stock arm is the patched routing"
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


def make(arm: str, root: Path) -> Linear:
    """The linear for ``arm``; UserError when that arm cannot run on this host."""
    why = availability().get(arm, f"unknown arm {arm!r}; choose from {ALL_ARMS}")
    if why:
        raise UserError(f"arm {arm!r} unavailable: {why}")
    if arm == "stock":
        return stock()
    if arm == CONTROL:
        return reordered()
    return MetalStreamed(root)
