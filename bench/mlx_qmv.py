"""Stock MLX and the MLX `patchkit build` made, timed through ``mx.quantized_matmul``.

  python3 bench/mlx_qmv.py run --stock PYTHON[:SITE] --patched PYTHON[:SITE] \
      --json mlx_qmv.json [--quick] [--dtype bfloat16] [--group-size 64] \
      [--calls chained|independent]
  python3 bench/mlx_qmv.py report mlx_qmv.json [--plot mlx_qmv.png]
  python3 bench/mlx_qmv.py page RUN.json... --out docs/results/cuda \
      --build-record BUILD/build-cuda.json   # .json, .md, .png

Each arm is an interpreter that imports its own MLX (``SITE``, when given, goes first on
its ``PYTHONPATH``: an unpacked stock wheel, say). The arms take turns, round after round,
on the same GPU in one run, and each time is the median over rounds. The floor is the
bytes a call reads over the bandwidth of an elementwise copy measured by the stock arm's
MLX on the same GPU.

Timing: a call's weights are cold (the arm cycles through copies of them that add up to
well over the L2), ``repeats`` calls are evaluated by one ``mx.eval`` after a
synchronize, and the wall time per call is what MLX's user sees, launch costs included.
By default (``--calls chained``) each call's x is made from the previous call's output,
as for a layer that needs the one before it: MLX's CUDA graph links a node only to the
nodes that made its inputs, so independent calls would run at once, and a kernel that
fills a fraction of the GPU (stock's ``qmm`` at a few vectors) would be timed by how
well its calls overlap, not by how long a call that needs the one before it waits for it
(``mx.depends`` links no GPU work, so the link is two small elementwise ops, timed alone
as well). Rows are compared by ``patchkit parity``; besides the times, this file measures
only M = 1's error against a float32 reference (:func:`m1_error`), once per arm, on the
same weights in both: the PR's M = 1 is a new kernel, whose bits may differ from stock's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # patchkit, from a checkout

# (K, N): Llama/Qwen-class projections, from 2**22 to 2**28 weights. 4096x1024 is a
# grouped-query k or v projection: too few rows to fill the GPU with one block per 16 rows.
SHAPES = [(4096, 1024), (4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]
QUICK_SHAPES = [(4096, 4096), (4096, 14336)]
# Every M up to 16, the widths speculative and multi-token decoding verify at once.
MS = list(range(1, 17))
BITS = (4, 8)
DTYPES, GROUPS = ("bfloat16", "float16"), (32, 64, 128)
ROUNDS, REPEATS = 3, 200  # rounds per arm; calls per timed graph
# How the timed calls relate: "chained" (each call's x made from the previous output, the
# time a call that needs the one before waits) or "independent" (MLX's graph may overlap
# them: the throughput of calls that do not depend on each other).
CALLS = ("chained", "independent")
NOISY = 1.5  # a cell whose rounds' slowest over fastest exceeds this is named on the page
COLD_BYTES = 1 << 29  # the weight copies one arm cycles through: ten times an H200's L2
ARMS = {"stock": {}, "pr": {}}
COPY_BYTES = 1 << 30  # the elementwise copy the floor's bandwidth is measured with
TINY_N, TINY_K = 16, 128  # the layer a call's own cost is timed on


def worker(
    cases: list[dict[str, Any]],
    repeats: int,
    dtype_name: str,
    group: int,
    calls: str,
    error: bool = False,
) -> list[dict[str, Any]]:
    """Time every case in this process's MLX; one entry per case, microseconds per call.
    With ``error``, each M = 1 entry also holds :func:`m1_error` of the case's layer: the
    weights are drawn from a seed of the case, so every arm is measured on the same ones."""
    import mlx.core as mx

    dtype = getattr(mx, dtype_name)
    # 32-bit elements (MLX's byte-wide elementwise kernels do not reach the memory's
    # speed); the best of three passes, so the first pass's allocations are not timed.
    src = mx.zeros((COPY_BYTES // 4,), dtype=mx.uint32)
    mx.eval(src)
    best = 0.0
    for _ in range(3):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval([src + i for i in range(5)])
        mx.synchronize()
        best = max(best, 2 * 5 * COPY_BYTES / (time.perf_counter() - start))
    del src
    chained = calls == "chained"
    call_us = _call_us(mx, dtype, group, repeats, chained)
    link_us = _link_us(mx, dtype, repeats)
    out: list[dict[str, Any]] = [{"copy_bytes_per_s": best, "call_us": call_us, "link_us": link_us}]
    for case in cases:
        K, N, bits = case["K"], case["N"], case["bits"]
        q, x1 = layer(mx, K, N, bits, dtype, group)
        size = sum(a.nbytes for a in q)
        err = m1_error(mx, q, x1, group, bits) if error else None
        copies = [[a + 0 for a in q] for _ in range(max(2, min(32, COLD_BYTES // size)))]
        mx.eval(copies)
        for M in case["Ms"]:
            x = mx.random.normal((M, K)).astype(dtype)
            mx.eval(x)
            us = _timed_us(mx, x, copies, bits, group, repeats, chained)
            row = {"K": K, "N": N, "bits": bits, "M": M, "us": us, "bytes": size}
            out.append({**row, "m1_error": err} if M == 1 and err is not None else row)
        del copies
        mx.clear_cache()
    return out


def layer(mx: Any, K: int, N: int, bits: int, dtype: Any, group: int) -> tuple[list[Any], Any]:
    """A case's quantized weights and one vector, drawn from a seed of the layer: every arm
    (every MLX) gets the same ones."""
    mx.random.seed(K * 1_000_003 + N * 31 + bits)
    q = mx.quantize(mx.random.normal((N, K)).astype(dtype), group_size=group, bits=bits)
    x = mx.random.normal((1, K)).astype(dtype)
    mx.eval(q, x)
    return list(q), x


def m1_error(mx: Any, q: list[Any], x: Any, group: int, bits: int) -> float:
    """The largest |error| of ``mx.quantized_matmul`` of one vector ``x`` on the default
    device against a float32 reference computed on the CPU (the same quantized weights
    dequantized with float32 scales and biases, times x in float32), over the reference's
    largest |output|, as the kernel-alone pages measure it. The arms draw the same weights
    and x, so their errors compare the kernels' summation, which may change M = 1's bits
    against stock (a new kernel), not the data."""
    wq, scales, biases = q
    f32 = mx.float32
    out = mx.quantized_matmul(x, wq, scales, biases, True, group, bits).astype(f32)
    w = mx.dequantize(wq, scales.astype(f32), biases.astype(f32), group, bits, stream=mx.cpu)
    ref = mx.matmul(x.astype(f32), w.T, stream=mx.cpu)
    return (mx.abs(out - ref).max() / mx.abs(ref).max()).item()


def _call_us(mx: Any, dtype: Any, group: int, repeats: int, chained: bool) -> float:
    """Microseconds per call of the same op on a layer too small to read any time (16 rows
    of 128 weights, 4-bit, one vector), timed as the cases are: what a call costs besides
    its bytes (building the graph's node, the launch, one block's latency)."""
    w = mx.quantize(mx.random.normal((TINY_N, TINY_K)).astype(dtype), group_size=group, bits=4)
    copies = [[a + 0 for a in w] for _ in range(2)]
    x = mx.random.normal((1, TINY_K)).astype(dtype)
    mx.eval(copies, x)
    return _timed_us(mx, x, copies, 4, group, repeats, chained)


def _link_us(mx: Any, dtype: Any, n: int) -> float:
    """Microseconds per link of ``n`` chained links alone (:func:`_link`, each on the x the
    one before made), timed as the calls are: the share of a chained call's time that is
    the bench's own."""
    x = mx.random.normal((1, TINY_K)).astype(dtype)
    mx.eval(x)

    def links() -> Any:
        y = x
        for _ in range(n):
            y = _link(y, y)
        return y

    return _per_call_us(mx, links, n)


def _link(x: Any, y: Any) -> Any:
    """x again (the same values), made from ``y``: the next call waits for the one that
    made ``y``. Two elementwise ops (MLX's CUDA graph links nodes by the buffers they read;
    ``mx.depends`` shares a buffer and adds no GPU node)."""
    return x + y[..., :1] * 0


def _timed_us(
    mx: Any, x: Any, copies: list[list[Any]], bits: int, group: int, n: int, chained: bool
) -> float:
    """Microseconds per call of ``n`` calls (:func:`_calls`), by :func:`_per_call_us`."""
    return _per_call_us(mx, lambda: _calls(mx, x, copies, bits, group, n, chained), n)


def _per_call_us(mx: Any, make: Any, n: int) -> float:
    """Microseconds per op of the ``n`` ops ``make()`` builds, evaluated by one ``mx.eval``
    after as many untimed: those warm the kernels, the graph cache and the output buffers'
    allocations (a process's first case timed them otherwise)."""
    mx.eval(make())
    mx.synchronize()
    start = time.perf_counter()
    mx.eval(make())
    mx.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def _calls(
    mx: Any, x: Any, copies: list[list[Any]], bits: int, group: int, n: int, chained: bool = True
) -> list[Any]:
    """``n`` calls against the weight copies in turn (each read cold); chained, one after
    another: each call's x is :func:`_link` of the previous x and output (both arms pay the
    link; the call's own cost includes it, and ``link_us`` times it alone)."""
    outs = []
    for i in range(n):
        outs.append(mx.quantized_matmul(x, *copies[i % len(copies)], True, group, bits))
        if chained:
            x = _link(x, outs[-1])
    return outs


def cases(quick: bool) -> list[dict[str, Any]]:
    return [
        {"K": K, "N": N, "bits": bits, "Ms": MS}
        for (K, N) in (QUICK_SHAPES if quick else SHAPES)
        for bits in BITS
    ]


def arm_env(site: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` with an arm's ``SITE`` (when given) first on its ``PYTHONPATH``."""
    if not site:
        return env
    return {
        **env,
        "PYTHONPATH": os.pathsep.join([site, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }


def run_arm(python: str, site: str, env: dict[str, str], job: dict[str, Any]
            ) -> list[dict[str, Any]]:  # fmt: skip
    """One round of one arm: a fresh interpreter with its own MLX."""
    full = arm_env(site, {**os.environ, **env})
    payload = json.dumps(job)
    done = subprocess.run(
        [python, __file__, "worker"], input=payload, capture_output=True, text=True, env=full
    )
    if done.returncode:
        raise SystemExit(f"{python} (arm) failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def mlx_of(python: str, site: str) -> str:
    """The MLX version an arm imports."""
    env = {**os.environ, **({"PYTHONPATH": site} if site else {})}
    code = "import mlx.core as mx; print(mx.__version__)"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=env,
                          check=True).stdout.strip()  # fmt: skip


def hardware() -> dict[str, Any]:
    query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm"
    try:
        gpu = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        gpu = "unknown"
    return {"gpu": gpu, "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count()}


def run(a: argparse.Namespace) -> None:
    # Here, not at the top: the workers run this file in the arms' Pythons, without patchkit.
    from patchkit.util import proc

    arms = {"stock": a.stock, "pr": a.patched}
    split = {name: proc.interpreter(spec) for name, spec in arms.items()}
    job = {"cases": cases(a.quick), "repeats": a.repeats, "dtype": a.dtype,
           "group": a.group_size, "calls": a.calls}  # fmt: skip
    rounds: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in arms}
    for r in range(a.rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for name in order:
            python, site = split[name]
            # M = 1's error once per arm (it is not timed, and the data do not change)
            rounds[name].append(run_arm(python, site, ARMS[name], {**job, "error": r == 0}))
            print(f"round {r + 1}/{a.rounds}: {name} done", file=sys.stderr, flush=True)
    copy = statistics.median(rr[0]["copy_bytes_per_s"] for rr in rounds["stock"])
    call = {name: statistics.median(rr[0]["call_us"] for rr in rounds[name]) for name in arms}
    link = {name: statistics.median(rr[0]["link_us"] for rr in rounds[name]) for name in arms}
    rows = []
    for i, first in enumerate(rounds["stock"][0][1:], start=1):
        row = {k: first[k] for k in ("K", "N", "bits", "M", "bytes")}
        for name in arms:
            each = [rr[i]["us"] for rr in rounds[name]]
            row[name + "_us"] = statistics.median(each)
            row[name + "_rounds_us"] = each  # the spread behind the median
            if "m1_error" in rounds[name][0][i]:
                row[name + "_m1_error"] = rounds[name][0][i]["m1_error"]
        row["floor_us"] = first["bytes"] / copy * 1e6
        rows.append(row)
    report = {
        "command": "python3 bench/mlx_qmv.py run " + shlex.join(sys.argv[2:]),
        "dtype": a.dtype,
        "group_size": a.group_size,
        "rounds": a.rounds,
        "repeats": a.repeats,
        "calls": a.calls,
        "mlx": {name: mlx_of(*split[name]) for name in ("stock", "pr")},
        "hardware": hardware(),
        "copy_bytes_per_s": copy,
        "call_us": call,
        "link_us": link,
        "rows": rows,
    }
    Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))


def pr_call_us(report: dict[str, Any]) -> float | None:
    """The PR arm's own cost of a call (:func:`_call_us`), or None where the run timed none."""
    return (report.get("call_us") or {}).get("pr")


def table(report: dict[str, Any]) -> str:
    """Time per call (µs) and the ratio to stock, per layer and M; with a run that timed a
    call's own cost, also :func:`least_us` over the PR's time: no call takes less, so this
    is how close it gets to what is within reach."""
    timed = pr_call_us(report) is not None
    extra = " least / PR |" if timed else ""
    lines = [
        "| bits | K x N | M | stock µs | PR µs | PR / stock | floor µs | floor / PR |" + extra,
        "|---|---|---|---|---|---|---|---|" + ("---|" if extra else ""),
    ]
    for r in report["rows"]:
        s, p, f = r["stock_us"], r["pr_us"], r["floor_us"]
        lines.append(
            f"| {r['bits']} | {r['K']}x{r['N']} | {r['M']} | {s:.1f} | {p:.1f} | "
            f"{p / s:.2f} | {f:.1f} | {f / p:.0%} |"
            + (f" {least_us(report, r) / p:.0%} |" if timed else "")
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Time vs M per layer and bits: stock, the PR, the floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["bits"], r["K"], r["N"]) for r in report["rows"]})
    bits_rows = sorted({k[0] for k in keys})
    cols = max(sum(k[0] == b for k in keys) for b in bits_rows)
    fig, axes = plt.subplots(len(bits_rows), cols, figsize=(4 * cols, 3.2 * len(bits_rows)),
                             squeeze=False)  # fmt: skip
    # one row of panels per bits, its layers left to right
    places = [(axes[i][j], key) for i, b in enumerate(bits_rows)
              for j, key in enumerate(k for k in keys if k[0] == b)]  # fmt: skip
    for ax, (bits, K, N) in places:
        rows = [r for r in report["rows"] if (r["bits"], r["K"], r["N"]) == (bits, K, N)]
        Ms = [r["M"] for r in rows]
        for arm, label in (("stock", "stock"), ("pr", "PR"), ("floor", "bytes / copy bandwidth")):
            ax.plot(Ms, [r[arm + "_us"] for r in rows], marker="o", label=label)
        ax.set_title(f"{bits}-bit {K}x{N}")
        ax.set_xlabel("M")
        ax.set_xticks(Ms)  # the M timed, and only those: M is a count
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("µs per call")
    axes[0][0].legend()
    fig.suptitle(f"mx.quantized_matmul, {report['dtype']}, group {report['group_size']}, "
                 f"{report['hardware']['gpu'].split(',')[0]}")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# What the CUDA work aims at (docs/decisions/0007, "Targets"): M = 1 within 2x of the
# floor; at most half of stock's time at M = 2..8 and no more than stock's at 9..16.
TARGETS = (("M = 1: floor / PR", 1, 1, "floor", 0.5), ("M = 2..8: PR / stock", 2, 8, "ratio", 0.5),
           ("M = 9..16: PR / stock", 9, 16, "ratio", 1.0))  # fmt: skip
BIG = 1 << 24  # the M = 1 target counts layers of at least this many weights
SCOPE = 1 << 23  # the targets are set on layers of 2^23 to 2^28 weights


def pr_link_us(report: dict[str, Any]) -> float:
    """The PR arm's link to the call before (:func:`_link_us`) where the run chains its
    calls, else 0: only a chained call waits for the link's two ops before its kernel."""
    if calls_of(report) != "chained":
        return 0.0
    return (report.get("link_us") or {}).get("pr") or 0.0


def least_us(report: dict[str, Any], row: dict[str, Any]) -> float:
    """The least time a call of ``row`` can take through MLX: its floor (the bytes at the
    copy bandwidth MLX measures) after the link to the call before where the run chains
    its calls (MLX's graph runs the link's two ops before the kernel that reads their
    output), or the PR arm's own cost of a call where the run timed one (``call_us``),
    whichever is larger; never more than the PR's measured time, which would disprove it."""
    bound = max(row["floor_us"] + pr_link_us(report), pr_call_us(report) or 0.0)
    return min(bound, row["pr_us"])


def layer_of(row: dict[str, Any]) -> tuple[int, int, int]:
    """A row's layer: bits, K and N (its M aside)."""
    return row["bits"], row["K"], row["N"]


def target_rows(report: dict[str, Any], lo: int, hi: int, kind: str) -> list[dict[str, Any]]:
    """A run's rows a target counts: its M range, and at M = 1 the layers of ``BIG``."""
    return [r for r in report["rows"] if lo <= r["M"] <= hi
            and (kind == "ratio" or r["K"] * r["N"] >= BIG)]  # fmt: skip


def target_value(kind: str, row: dict[str, Any], pr_us: float, stock_us: float) -> float:
    """What a target compares with its goal: floor / PR, or PR / stock."""
    return row["floor_us"] / pr_us if kind == "floor" else pr_us / stock_us


def meets_target(kind: str, goal: float, value: float) -> bool:
    """floor / PR at least the goal; PR / stock at most."""
    return value >= goal if kind == "floor" else value <= goal


def against_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per target: the worst and best value over the run's layers and bits, how many meet
    it (floor / PR at least the target; PR / stock at most), and how many are out of
    reach (``out_of_reach``: even :func:`least_us` misses it; e.g. where stock's ``qmm``
    runs within twice the floor, PR / stock <= 0.5 needs more than MLX's copy bandwidth).
    A row that meets its target is never out of reach. The rest of the misses, those the
    bound allows, are listed (``misses_in_reach``: the PR's time, the time that would meet
    the target and the bound's, and the PR's M = 1 time on the layer where the run has
    it), so a page says how close each gets, not only how many."""
    out = []
    m1_us = {layer_of(r): r["pr_us"] for r in report["rows"] if r["M"] == 1}
    for label, lo, hi, kind, goal in TARGETS:
        rows = target_rows(report, lo, hi, kind)
        values = [target_value(kind, r, r["pr_us"], r["stock_us"]) for r in rows]
        if not values:
            out.append({"target": label, "goal": goal, "worst": None, "best": None,
                        "met": 0, "of": 0, "out_of_reach": 0, "misses_in_reach": []})  # fmt: skip
            continue
        leasts = [least_us(report, r) for r in rows]
        bounds = [r["floor_us"] / least if kind == "floor" else least / r["stock_us"]
                  for r, least in zip(rows, leasts, strict=True)]  # fmt: skip
        worst = min(values) if kind == "floor" else max(values)
        best = max(values) if kind == "floor" else min(values)

        def meets(value: float, kind: str = kind, goal: float = goal) -> bool:
            return meets_target(kind, goal, value)

        met = sum(map(meets, values))
        beyond = sum(not meets(b) for b in bounds)
        misses = [
            {"bits": r["bits"], "K": r["K"], "N": r["N"], "M": r["M"], "value": v,
             "pr_us": r["pr_us"], "least_us": least, "pr_m1_us": m1_us.get(layer_of(r)),
             "goal_us": r["floor_us"] / goal if kind == "floor" else goal * r["stock_us"]}
            for r, v, b, least in zip(rows, values, bounds, leasts, strict=True)
            if not meets(v) and meets(b)
        ]  # fmt: skip
        out.append({"target": label, "goal": goal, "worst": worst, "best": best,
                    "met": met, "of": len(values), "out_of_reach": beyond,
                    "misses_in_reach": misses})  # fmt: skip
    return out


def in_scope_line(runs: list[dict[str, Any]]) -> list[str]:
    """The targets' counts over all runs without the layers below ``SCOPE`` weights, which
    the pages time (a grouped-query k or v projection) and count above, but the issue's
    targets leave out: a reader sees both, and which layers make the difference."""
    small = sorted({(r["K"], r["N"]) for run in runs for r in run["rows"]
                    if r["K"] * r["N"] < SCOPE})  # fmt: skip
    if not small:
        return []
    totals: dict[str, list[int]] = {}
    for run in runs:
        kept = {**run, "rows": [r for r in run["rows"] if r["K"] * r["N"] >= SCOPE]}
        for t in against_targets(kept):
            met, of, beyond, near = totals.setdefault(t["target"], [0, 0, 0, 0])
            totals[t["target"]] = [met + t["met"], of + t["of"], beyond + t["out_of_reach"],
                                   near + len(t["misses_in_reach"])]  # fmt: skip
    counts = "; ".join(
        f"{target}: {met} of {of} meet it, {beyond} out of reach, {near} missed within reach"
        for target, (met, of, beyond, near) in totals.items() if of
    )  # fmt: skip
    layers = ", ".join(f"{K}x{N}" for K, N in small)
    return [f"Counted above, the layers below the issue's 2^23 weights ({layers}); over every "
            f"run without them: {counts}.", ""]  # fmt: skip


def round_verdicts(kind: str, goal: float, row: dict[str, Any]) -> list[bool]:
    """A row's verdict in each round: that round's PR time against stock's of the same
    round (the arms take turns, so a round's two times are neighbours in time)."""
    pairs = zip(row.get("pr_rounds_us", []), row.get("stock_rounds_us", []), strict=True)
    return [meets_target(kind, goal, target_value(kind, row, pr, stock)) for pr, stock in pairs]


def rounds_line(runs: list[dict[str, Any]]) -> list[str]:
    """How many of the targets' verdicts the rounds' noise could turn: the cells counted
    as meeting (by the medians) that miss in some round, and the misses that meet in
    some round (:func:`round_verdicts`). A verdict near its goal is only as firm as this
    says; runs without two or more rounds recorded per row give no line."""
    # per target: [met, met but missed in a round, missed, missed but met in a round]
    totals: dict[str, list[int]] = {}
    for run in runs:
        for label, lo, hi, kind, goal in TARGETS:
            for r in target_rows(run, lo, hi, kind):
                rounds = round_verdicts(kind, goal, r)
                if len(rounds) < 2:
                    return []
                median = meets_target(kind, goal, target_value(kind, r, r["pr_us"], r["stock_us"]))
                tally = totals.setdefault(label, [0, 0, 0, 0])
                at = 0 if median else 2
                tally[at] += 1
                tally[at + 1] += any(v != median for v in rounds)
    if not totals:
        return []

    def sides(met: int, met_turned: int, missed: int, missed_turned: int) -> str:
        return ", ".join(
            ([f"{met_turned} of the {met} that meet it miss it in some round"] if met else [])
            + ([f"{missed_turned} of the {missed} that miss it meet it in some round"]
               if missed else [])
        )  # fmt: skip

    counts = "; ".join(f"{label}: {sides(*tally)}" for label, tally in totals.items())
    return [f"Verdicts the rounds could turn (each round's PR time against stock's of the same "
            f"round; over every run): {counts}.", ""]  # fmt: skip


def misses_table(summary: list[dict[str, Any]]) -> list[str]:
    """The misses :func:`against_targets` finds within reach, one line each: where kernel
    work can still gain, and by how much (the PR's time against the one that meets)."""
    rows = [(s, t, m) for s in summary for t in s["targets"] for m in t.get("misses_in_reach", [])]
    if not rows:
        return []
    # M > 1 misses whose target is no slower than the PR's own M = 1 call on the layer:
    # one call of more vectors does more work than one of a single vector, so only a
    # faster M = 1 call meets them, not the sharing of weight reads.
    single = [m for _, _, m in rows if m["M"] > 1 and m.get("pr_m1_us") is not None
              and m["goal_us"] <= m["pr_m1_us"]]  # fmt: skip
    batched = sum(m["M"] > 1 for _, _, m in rows)

    def us(value: float | None) -> str:
        return "" if value is None else f"{value:.1f}"

    return [
        "## Missed, not out of reach",
        "",
        "Each row that misses its target although the bound above allows it: the PR's time, "
        "the time that would meet the target, and the bound's. The bound is the larger of "
        "two lower limits (floor after the link; a call's own cost), not their sum: a call "
        "pays both its bytes and most of a call's own cost, so a miss whose target lies "
        "within a few µs of the bound may be out of reach too.",
        "",
        f"Of the {batched} at M > 1, {len(single)} would meet their target only in less "
        "time than the PR's own M = 1 call on the layer (PR µs at M = 1): a call of more "
        "vectors does all of a single vector's work and more, so there a faster "
        "single-vector call is what is missing, not the sharing of weight reads.",
        "",
        "| dtype | group | target | bits | K x N | M | value | PR µs | meets at µs | bound µs "
        "| PR µs at M = 1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *(
            f"| {s['dtype']} | {s['group_size']} | {t['target']} (target {t['goal']}) | "
            f"{m['bits']} | {m['K']}x{m['N']} | {m['M']} | {m['value']:.2f} | "
            f"{m['pr_us']:.1f} | {m['goal_us']:.1f} | {m['least_us']:.1f} | "
            f"{us(m.get('pr_m1_us'))} |"
            for s, t, m in rows
        ),
        "",
    ]


def ratios(report: dict[str, Any]) -> str:
    """PR / stock per layer and bits (rows) and M (columns), and M = 1's bandwidth."""
    ms = sorted({r["M"] for r in report["rows"]})
    keys = sorted({(r["bits"], r["K"], r["N"]) for r in report["rows"]})
    lines = ["| bits | K x N | M = 1 TB/s | " + " | ".join(f"M = {m}" for m in ms) + " |",
             "|---|---|---|" + "---|" * len(ms)]  # fmt: skip
    for bits, K, N in keys:
        by_m = {r["M"]: r for r in report["rows"] if (r["bits"], r["K"], r["N"]) == (bits, K, N)}
        one = by_m[ms[0]]
        cells = [f"{by_m[m]['pr_us'] / by_m[m]['stock_us']:.2f}" if m in by_m else "" for m in ms]
        lines.append(f"| {bits} | {K}x{N} | {one['bytes'] / one['pr_us'] / 1e6:.2f} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines)


def run_name(report: dict[str, Any]) -> str:
    return f"{report['dtype']}-{report['group_size']}.json"


def generic_command(report: dict[str, Any]) -> str:
    """The run's command with the arms' paths as placeholders (they are one host's), and
    every option that changes what it measures, read from the run itself."""
    layers = {(r["K"], r["N"]) for r in report["rows"]}
    extra = [
        *(["--quick"] if layers <= set(QUICK_SHAPES) else []),
        *([f"--rounds {report['rounds']}"] if report["rounds"] != ROUNDS else []),
        *([f"--repeats {report['repeats']}"] if report["repeats"] != REPEATS else []),
        *([f"--calls {calls_of(report)}"] if calls_of(report) != CALLS[0] else []),
    ]
    return " ".join(["python3 bench/mlx_qmv.py run --stock STOCK_PYTHON[:SITE] --patched "
                     f"<cache>/builds/cuda-<pin>/venv/bin/python --json {run_name(report)} "
                     f"--dtype {report['dtype']} --group-size {report['group_size']}",
                     *extra])  # fmt: skip


def calls_of(report: dict[str, Any]) -> str:
    """How a run's calls relate (:data:`CALLS`); a run from before ``--calls`` timed
    independent calls."""
    return report.get("calls", "independent")


# How a run's calls relate, as its page says it.
CALLS_TEXT = {
    "chained": "Each call's x is made from the previous call's output (x + 0 · y[:, :1], two "
    "small elementwise ops in both arms), so the calls run one after another, as a layer "
    "that needs the one before it does (MLX's graph still overlaps calls that do not, such "
    "as a layer's q, k and v projections).",
    "independent": "The calls are independent of each other, so MLX's CUDA graph may run "
    "several at once: a kernel that fills a fraction of the GPU is timed by how its calls "
    "overlap, not by how long a dependent call waits for it.",
}


def call_line(runs: list[dict[str, Any]]) -> list[str]:
    """The page's line on a call's own cost, per run (none for runs that did not time it)."""
    if not all(r.get("call_us") for r in runs):
        return []
    each = {arm: ", ".join(f"{r['call_us'][arm]:.1f}" for r in runs) for arm in ("stock", "pr")}
    link = ""
    if all(r.get("link_us") and calls_of(r) == "chained" for r in runs):
        links = {arm: ", ".join(f"{r['link_us'][arm]:.1f}" for r in runs) for arm in each}
        link = (" It includes the link to the call before (two elementwise ops), which alone, "
                f"chained, takes: stock {links['stock']} µs; PR {links['pr']} µs.")  # fmt: skip
    return [
        f"- A call's own cost (the same op on a {TINY_N}x{TINY_K} 4-bit layer, one vector, "
        f"timed as the layers are; median of the rounds, per run): stock {each['stock']} µs; "
        f"PR {each['pr']} µs.{link} No call takes less than the larger of its floor"
        f"{' plus that link' if link else ''} and that cost (`least / PR` in the table of "
        "times): where that is over twice the floor, floor / PR cannot reach 0.5 through MLX."
    ]


def spread_line(runs: list[dict[str, Any]]) -> list[str]:
    """The page's line on the spread behind the medians: per arm, the median and largest
    slowest-over-fastest of a cell's rounds, and the cells over :data:`NOISY` in either arm
    (the noisiest named), whose ratios are medians of rounds that disagree."""
    timed = ("stock_rounds_us", "pr_rounds_us")
    cells = [(run, row) for run in runs for row in run["rows"]
             if all(len(row.get(key) or ()) > 1 for key in timed)]  # fmt: skip
    if not cells:
        return []

    def spread(row: dict[str, Any], arm: str) -> float:
        return max(row[f"{arm}_rounds_us"]) / min(row[f"{arm}_rounds_us"])

    each = {arm: sorted(spread(row, arm) for _, row in cells) for arm in ("stock", "pr")}
    worst = [(max(spread(row, "stock"), spread(row, "pr")), run, row) for run, row in cells]
    noisy = [cell for cell in worst if cell[0] > NOISY]
    line = (
        "- Spread behind the medians (a cell's slowest round over its fastest): stock "
        f"median {statistics.median(each['stock']):.2f}, largest {each['stock'][-1]:.2f}; PR "
        f"median {statistics.median(each['pr']):.2f}, largest {each['pr'][-1]:.2f}. "
    )
    if noisy:
        most, run, row = max(noisy, key=lambda cell: cell[0])
        line += (
            f"{len(noisy)} of {len(cells)} cells spread over {NOISY}x in an arm (the most: "
            f"{run['dtype']}, group {run['group_size']}, {row['bits']}-bit {row['K']}x{row['N']}, "
            f"M = {row['M']}, {most:.2f}x); their ratios are medians of rounds that disagree "
            "(every round is in the JSON)."
        )
    else:
        line += f"No cell spreads over {NOISY}x."
    return [line]


def error_lines(runs: list[dict[str, Any]]) -> list[str]:
    """The page's section on M = 1's error against float32 in both arms (:func:`m1_error`),
    for the runs that measured it: how far the PR's new M = 1 bits are from the exact
    product, beside stock's."""
    from patchkit.verify.harness.cuda import ErrorCell, error_table  # not in the arms' MLX

    cells = [ErrorCell(run["dtype"], run["group_size"], row["bits"], row["pr_m1_error"],
                       row["stock_m1_error"])
             for run in runs for row in run["rows"]
             if "pr_m1_error" in row and "stock_m1_error" in row]  # fmt: skip
    if not cells:
        return []
    return [
        "## M = 1 against a float32 reference",
        "",
        "Both arms on the same weights and vector (drawn from a seed of the layer), each "
        "arm's output against the product computed in float32 on the CPU from the same "
        "quantized weights; not timed. The PR's M = 1 is a new kernel, so its bits may "
        "differ from stock's; this is in which direction.",
        "",
        *error_table(cells, "PR"),
        "",
    ]


def timed_build(runs: list[dict[str, Any]], build_record: dict[str, Any]) -> dict[str, str]:
    """What the page holds for (decision 0008): the build record of the PR arm's MLX,
    reduced to its wheel and the build inputs it compiled. A speed page stays valid as long
    as those inputs do, whatever other commits (Metal's, say) the series gains since."""
    wheel = build_record.get("wheel_version")
    inputs = build_record.get("patch", {}).get("build_inputs_sha256")
    if not wheel or not inputs:
        raise SystemExit("--build-record: not a patchkit build record (no wheel_version or "
                         "patch.build_inputs_sha256)")  # fmt: skip
    if timed := {r["mlx"]["pr"] for r in runs} - {wheel}:
        raise SystemExit(f"--build-record is of MLX {wheel}, the runs timed {', '.join(timed)}")
    return {"backend": build_record.get("backend", "cuda"), "wheel_version": wheel,
            "build_inputs_sha256": inputs}  # fmt: skip


def page(runs: list[dict[str, Any]], out: Path, notes: list[str], build: dict[str, str]) -> None:
    """One results page from several runs (dtype x group): ``out``.json, .md and .png;
    ``notes`` (what a reader must know about the runs) go to both; ``build`` is
    :func:`timed_build` of the PR arm."""
    from patchkit.carry import mlx_build  # here: the arms' workers run this file too

    for key in ("mlx", "hardware", "rounds", "repeats", "calls"):
        values = [calls_of(r) if key == "calls" else r[key] for r in runs]
        if len({json.dumps(v, sort_keys=True) for v in values}) > 1:
            raise SystemExit(f"the runs differ in {key}: one page is of one pair of builds, "
                             "one GPU and one method")  # fmt: skip
    main_run = next((r for r in runs if (r["dtype"], r["group_size"]) == ("bfloat16", 64)), runs[0])
    first = runs[0]
    summary = [{"dtype": r["dtype"], "group_size": r["group_size"], "targets": against_targets(r)}
               for r in runs]  # fmt: skip
    record = {"build": build, "runs": [{**r, "command": generic_command(r)} for r in runs],
              "summary": summary, "notes": notes}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    try:
        plot(main_run, out.with_suffix(".png"))
        image = [f"![time vs M, {main_run['dtype']}, group {main_run['group_size']}]"
                 f"({out.name}.png)", ""]  # fmt: skip
    except ImportError:
        print("matplotlib is not installed: the page has no plot", file=sys.stderr)
        image = []
    gbs = ", ".join(f"{r['copy_bytes_per_s'] / 1e12:.2f}" for r in runs)
    lines = [
        "# CUDA through MLX: `mx.quantized_matmul`, the PR's build beside stock",
        "",
        f"- Arms: stock MLX {first['mlx']['stock']} (its CUDA wheels) and MLX "
        f"{first['mlx']['pr']} (`patchkit build --backend cuda`), taking turns in one run, "
        f"{first['rounds']} rounds of each. Time per call: {first['repeats']} calls evaluated "
        "by one `mx.eval` (MLX commits them as CUDA graphs of up to 100 nodes on sm90), over "
        "their count; the median of the rounds. Each call reads a cold copy of the weights; "
        "launch costs included. " + CALLS_TEXT[calls_of(first)],
        mlx_build.valid_while(build["backend"], build["build_inputs_sha256"]) + ".",
        "- Stock's wheels come from MLX's release builds and the PR's arm from a local build, "
        "so compiler and build flags may differ between the arms besides the patch; the pin "
        "built the same way without the patch, given as `--stock`, would remove that.",
        f"- Hardware: {first['hardware']['gpu']}; {first['hardware']['cpus']} CPUs.",
        "- Floor: the bytes a call reads (weights, scales, biases) over the bandwidth of an "
        "elementwise copy MLX runs in the same run (a 32-bit add over 1 GiB, best of three; "
        f"TB/s, per run: {gbs}); below the HBM's nominal bandwidth, so floor / PR reads "
        "higher than a fraction of the nominal would.",
        *call_line(runs),
        *spread_line(runs),
        "- Rows: not timed here. The same build's parity (every row at M·B ≤ 16 against "
        "M = 1, bit for bit) is `build-cuda.md`.",
        "- Commands, one run per dtype and group size, then this page:",
        "",
        "```",
        *(r["command"] for r in record["runs"]),
        "python3 bench/mlx_qmv.py page "
        + " ".join(map(run_name, runs))
        + f" --out docs/results/{out.name} --build-record build-cuda.json"
        + "".join(f" --note {shlex.quote(n)}" for n in notes),
        "```",
        *(f"- Note: {n}" for n in notes),
        "",
        "## Against the targets",
        "",
        "Over every layer and bits (M = 1: layers of at least 2^24 weights) and every M in "
        "the range; M = 8 and up is stock's `qmm`. Out of reach: rows where meeting the "
        "target would need a call faster than its floor, the bytes at the copy bandwidth "
        "MLX measures, after the link to the call before where calls are chained (or, in a "
        "run that timed it, than a call's own cost): e.g. PR / stock <= 0.5 where stock's "
        "`qmm` runs within twice that.",
        "",
        "| dtype | group | " + " | ".join(f"{t[0]} (target {t[4]})" for t in TARGETS) + " |",
        "|---|---|" + "---|" * len(TARGETS),
        *(
            f"| {s['dtype']} | {s['group_size']} | "
            + " | ".join(
                f"worst {t['worst']:.2f}, best {t['best']:.2f}; {t['met']} of {t['of']} meet it"
                + (f", {t['out_of_reach']} out of reach" if t.get("out_of_reach") else "")
                if t["of"]
                else "not measured"
                for t in s["targets"]
            )
            + " |"
            for s in summary
        ),
        "",
        *in_scope_line(runs),
        *rounds_line(runs),
        *image,
        *misses_table(summary),
    ]
    lines += error_lines(runs)
    for r in runs:
        lines += [f"## PR / stock: {r['dtype']}, group {r['group_size']}", "", ratios(r), ""]
    lines += [f"## Times: {main_run['dtype']}, group {main_run['group_size']}", "",
              table(main_run), ""]  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="time the arms, side by side")
    r.add_argument("--stock", required=True, help="PYTHON[:SITE] importing stock MLX")
    r.add_argument("--patched", required=True, help="PYTHON[:SITE] importing the patched MLX")
    r.add_argument("--json", required=True)
    r.add_argument("--rounds", type=int, default=ROUNDS)
    r.add_argument("--repeats", type=int, default=REPEATS)
    r.add_argument("--quick", action="store_true", help="two layers")
    r.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="activations, output")
    r.add_argument("--group-size", type=int, choices=GROUPS, default=64)
    r.add_argument(
        "--calls",
        choices=CALLS,
        default=CALLS[0],
        help="each call's x made from the previous output, or none (overlapped)",
    )
    rep = sub.add_parser("report", help="the table (and a plot) of a run's JSON")
    rep.add_argument("json")
    rep.add_argument("--plot")
    pg = sub.add_parser("page", help="the results page of several runs: OUT.json/.md/.png")
    pg.add_argument("runs", nargs="+", type=Path)
    pg.add_argument("--out", required=True, type=Path, help="e.g. docs/results/cuda")
    pg.add_argument("--note", action="append", default=[], help="a fact about the runs")
    pg.add_argument(
        "--build-record",
        required=True,
        type=Path,
        help="the build-cuda.json of the PR arm's build (patchkit build)",
    )
    sub.add_parser("worker", help="internal: one arm's round (cases on stdin)")
    a = ap.parse_args()
    if a.cmd == "worker":
        job = json.loads(sys.stdin.read())
        print(json.dumps(worker(job["cases"], job["repeats"], job["dtype"], job["group"],
                                job["calls"], job.get("error", False))))  # fmt: skip
    elif a.cmd == "run":
        run(a)
    elif a.cmd == "page":
        runs = [json.loads(p.read_text()) for p in a.runs]
        build = timed_build(runs, json.loads(a.build_record.read_text()))
        page(runs, a.out, a.note, build)
    else:
        report = json.loads(Path(a.json).read_text())
        print(table(report))
        if a.plot:
            plot(report, Path(a.plot))


if __name__ == "__main__":
    main()
