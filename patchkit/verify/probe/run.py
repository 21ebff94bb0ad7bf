"""One probe run: build the model per bit width, prefill, then per arm and T the verdicts.

This is the library entry point the CLI and the device driver both call
(:func:`run`); it returns one JSON-able payload and never prints.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from patchkit.errors import UserError
from patchkit.verify.probe import exact, linears, speed
from patchkit.verify.probe.model import SIZES, Model, Trace, build, empty_cache, forward

LINEAR_OPS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
)
MAX_T = 16
ATTENTION = ("fused", "per_query")


@dataclass
class Options:
    """What to run; defaults are the CPU test's small run minus the timing."""

    size: str = "tiny"
    bits: tuple[int, ...] = (4, 8)
    arms: tuple[str, ...] = linears.ARMS
    ts: tuple[int, ...] = tuple(range(2, MAX_T + 1))
    prompt_len: int = 32
    seed: int = 0
    dtype: str = "bfloat16"
    per_op: bool = True
    timing: bool = False
    timing_ts: tuple[int, ...] = (2, 4, 6, 8, 12, 16)
    repeats: int = 5
    alpha: float = 0.7
    # Unused: the CUDA streamed arm's JIT header (linears says why there is none); kept
    # while the CLI's --cuda-header still passes it.
    root: Path = Path(".")
    deadline_s: float | None = None  # no new (bits, arm) after this many seconds
    attention: str = "fused"  # or "per_query" (see model.Model.attention)

    def validate(self) -> None:
        """UserError for inputs the probe cannot honour, with the fix in the message."""
        if self.size not in SIZES:
            raise UserError(f"unknown --size {self.size!r}; choose from {', '.join(SIZES)}")
        if not set(self.bits) <= {4, 8}:
            raise UserError("--bits must be 4 or 8 (the widths the streamed kernel carries)")
        if not self.ts or min(self.ts) < 2 or max(self.ts) > MAX_T:
            raise UserError(f"T must lie in 2..{MAX_T}")
        if self.prompt_len < 1:
            raise UserError("--prompt-len must be at least 1")
        if self.attention not in ATTENTION:
            raise UserError(f"--attention must be one of {', '.join(ATTENTION)}")
        if not 0.0 <= self.alpha <= 1.0:
            raise UserError("--acceptance must lie in [0, 1]")


def environment() -> dict[str, Any]:
    """Versions, backend and device, recorded beside the numbers."""
    import mlx.core as mx

    wheels = {}
    for dist in ("mlx", "mlx-cpu", "mlx-cuda-13", "mlx-cuda-12", "mlx-metal"):
        try:
            wheels[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        device: Any = mx.device_info()
    except (AttributeError, RuntimeError):
        device = str(mx.default_device())
    return {
        "mlx": mx.__version__,
        "wheels": wheels,
        "backend": linears.backend(),
        "device": device,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def _tokens(spec_vocab: int, n: int, seed: int) -> Any:
    import mlx.core as mx

    return mx.random.randint(0, spec_vocab, (n,), key=mx.random.key(seed)).astype(mx.uint32)


def summarize(per_t: list[dict[str, Any]], ops: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The verdict lines: end to end, linears alone, and which other ops differ at which T."""
    failing = [v["T"] for v in per_t if not v["identical"]]
    by_op: dict[str, list[int]] = {}
    for t, table in ops.items():
        for name, rec in table.items():
            if rec["rows_differing"]:
                by_op.setdefault(name, []).append(int(t))
    lin = {k: v for k, v in by_op.items() if k in LINEAR_OPS}
    return {
        "identical_all_T": not failing,
        "T_differing": failing,
        "first_T_differing": failing[0] if failing else None,
        "start_states_identical": all(
            v["start_state_block"] == v["start_state_chain"] for v in per_t
        ),
        "per_op_checked": bool(ops),
        "linears_identical_all_T": (not lin) if ops else None,
        "ops_differing_at_T": by_op,
    }


def probe_arm(model: Model, arm: str, opts: Options, prompt: Any, drafts: Any) -> dict[str, Any]:
    """Every T for one arm from one prefilled state, plus per-op parity and timing."""
    import mlx.core as mx

    lin = linears.make(arm, opts.root)
    # Prefill with stock MLX for every arm: the state both arms verify from is the same.
    _, cache0 = forward(model, prompt, empty_cache(model), linears.stock())
    mx.eval(cache0)
    per_t, ops = [], {}
    for t in opts.ts:
        trace = Trace() if opts.per_op else None
        per_t.append(asdict(exact.block_vs_chain(model, drafts[:t], cache0, lin, trace)))
        if trace is not None:
            ops[t] = exact.per_op(trace)
    out: dict[str, Any] = {"bits": model.bits, "arm": arm, "per_T": per_t, "per_op": ops}
    out["summary"] = summarize(per_t, ops)
    if opts.timing:
        timed = [t for t in opts.timing_ts if t <= max(opts.ts)]  # drafts hold max(ts) tokens
        times = speed.time_arm(model, drafts, cache0, lin, timed, opts.repeats)
        out["timing"] = times
        out["throughput"] = speed.throughput(times, opts.alpha)
    return out


def run(
    opts: Options,
    progress: Callable[[str], None] = lambda _m: None,
    on_result: Callable[[dict[str, Any]], None] = lambda _p: None,
) -> dict[str, Any]:
    """The whole probe; ``on_result`` sees the payload after each (bits, arm), for dumps."""
    opts.validate()
    spec = SIZES[opts.size]
    avail = linears.availability()
    arms = [a for a in opts.arms if avail.get(a) is None]
    payload: dict[str, Any] = {
        "environment": environment(),
        "model": asdict(spec),
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(opts).items()},
        "arms_run": arms,
        "arms_skipped": {a: avail[a] for a in opts.arms if avail.get(a)},
        "prefill": "stock quantized_matmul for every arm (M = prompt length)",
        "attention": opts.attention,
        "streamed_routing": "M = 1 stays on stock quantized_matmul; M >= 2 the streamed kernel",
        "formula": speed.FORMULA,
        "results": [],
    }
    prompt = _tokens(spec.vocab, opts.prompt_len, opts.seed + 1)
    drafts = _tokens(spec.vocab, max(opts.ts), opts.seed + 2)
    t0 = time.perf_counter()
    payload["skipped_for_deadline"] = []
    for bits in opts.bits:
        progress(f"building {spec.name} at {bits} bits")
        model = build(spec, bits, opts.seed, opts.dtype)
        model.attention = opts.attention
        for arm in arms:
            if opts.deadline_s is not None and time.perf_counter() - t0 > opts.deadline_s:
                payload["skipped_for_deadline"].append({"bits": bits, "arm": arm})
                continue
            progress(f"{bits}-bit {arm}: block vs chain for T = {list(opts.ts)}")
            payload["results"].append(probe_arm(model, arm, opts, prompt, drafts))
            on_result(payload)
        del model
    return payload
