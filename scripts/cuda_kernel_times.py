"""Kernel-only times of quantized_matmul per M, read by Nsight Compute, for builds side by side.

`cuda_compiled_bench.py` times wall clock over back-to-back calls. Where a call's kernel
takes a few microseconds (1024x1024), that clock reads the host's work per call, and two
builds differ there even on the same kernel. This reads the GPU's own duration of every
kernel instead: ``ncu --metrics gpu__time_duration.sum`` (one replay per kernel, clocks
left alone), one ncu process per arm, round and configuration. ncu flushes the caches
before each kernel, so the weights come from HBM, as in decoding, where the other layers'
weights have evicted them; the wall-clock grid reuses one weight set, which a 1024x1024
layer keeps in L2. Both arms are read the same way; compare ratios, not the two tools'
absolute times.

Attribution without names: in the profiled process, each M's block of calls is preceded by
a marker (``mx.arange``, a kernel no quantized_matmul launches), so the kernels between two
markers are that M's calls, however many kernels a call launches (the streamed route may
launch more than one). Per M: the summed durations / calls, and the kernels per call.

Usage (on the GPU host; arms as in cuda_compiled_bench.py):
  python3 scripts/cuda_kernel_times.py --arm stock=PYTHON:SITE --arm patched=PYTHON \\
      --config 1024,1024,8,128,bfloat16 [--config ...] [--calls 5] --out kernel-times.json
Here (CPU): `--parse FILE.csv` prints what the parser reads from an ncu CSV, and
`--report kernel-times.json [--against stock]` prints a markdown table of ratios per M.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))  # the sibling scripts below
from cuda_compiled_bench import gpu_name, parse_arms, problem
from cuda_compiled_report import label, ms_header

MS = tuple(range(1, 8))  # the default route: M * B < 8
MARKER = "arange"  # the marker op's kernel name contains this
METRIC = "gpu__time_duration.sum"
# Both spellings ncu has used for time units; --print-units base asks for the base unit, ns.
UNIT_US = {
    **{"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6},
    **{"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6},
}
BASE_UNIT = "nsecond"  # what a CSV without a units row is in (--print-units base)


def launch(cfg: dict[str, Any], ms: tuple[int, ...], calls: int) -> None:
    """The profiled process: setup, then per M a marker and ``calls`` separate evals."""
    import mlx.core as mx

    qmm, vectors = problem(cfg)  # the wall-clock bench's weights and vectors
    xs = {m: mx.contiguous(vectors[:m]) for m in ms}
    mx.eval(*xs.values())
    mx.synchronize()
    for m in ms:
        mx.eval(mx.arange(m + 1))  # the marker: the next kernels are this M's
        mx.synchronize()
        for _ in range(calls):
            mx.eval(qmm(xs[m]))
        mx.synchronize()


def parse_ncu_csv(text: str) -> list[tuple[str, float]]:
    """(kernel name, duration in us) per profiled kernel, in launch order, from ``--page raw``.

    The header row names the columns (``Kernel Name`` and the metric); a row of units
    may follow it (without one, the values are in BASE_UNIT, which ``--print-units base``
    asks for); any line before the header (ncu's own ``==PROF==`` lines) is skipped. A
    unit it does not know is an error that quotes it, never a guess.
    """
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if "Kernel Name" in ln and "," in ln), None)
    if start is None:
        raise ValueError("no 'Kernel Name' header in the ncu CSV")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = rows[0]
    name_col, metric_col = header.index("Kernel Name"), header.index(METRIC)
    id_col = header.index("ID")
    scale = UNIT_US[BASE_UNIT]
    out: list[tuple[int, str, float]] = []
    for row in rows[1:]:
        if len(row) <= max(name_col, metric_col):
            continue
        if not row[id_col].strip().isdigit():  # the units row
            unit = row[metric_col].strip()
            if unit not in UNIT_US:
                raise ValueError(f"unknown unit {unit!r} for {METRIC} in the ncu CSV")
            scale = UNIT_US[unit]
            continue
        value = float(row[metric_col].replace(",", ""))
        out.append((int(row[id_col]), row[name_col], value * scale))
    return [(name, us) for _, name, us in sorted(out)]


def per_m(kernels: list[tuple[str, float]], ms: tuple[int, ...], calls: int) -> dict[int, Any]:
    """Split the launch-ordered kernels at the markers: per M, us per call and kernels per call."""
    blocks: list[list[tuple[str, float]]] = []
    for name, us in kernels:
        if MARKER in name:
            blocks.append([])
        elif blocks:
            blocks[-1].append((name, us))
    if len(blocks) != len(ms):
        raise ValueError(f"{len(blocks)} marker blocks for {len(ms)} values of M")
    out = {}
    for m, block in zip(ms, blocks, strict=True):
        if not block or len(block) % calls:
            raise ValueError(f"M = {m}: {len(block)} kernels for {calls} calls")
        out[m] = {
            "us_per_call": sum(us for _, us in block) / calls,
            "kernels_per_call": len(block) // calls,
            "kernels": sorted({name for name, _ in block}),
        }
    return out


def median_per_m(rounds: list[dict[Any, Any]]) -> dict[int, float]:
    """Per M, the median over the rounds that finished of the us per call."""
    done = [r for r in rounds if "error" not in r]
    return {m: statistics.median(r[m]["us_per_call"] for r in done) for m in (done or [{}])[0]}


def profile(arm: tuple[str, str, dict[str, str]], cfg: dict[str, Any], a: Any) -> dict[int, Any]:
    """One ncu process for one arm and configuration."""
    python, site, env = arm
    full_env = {**os.environ, **env}
    if site:
        full_env["PYTHONPATH"] = site + os.pathsep + full_env.get("PYTHONPATH", "")
    cmd = [
        a.ncu, "--clock-control", "none", "--metrics", METRIC, "--print-units", "base",
        "--csv", "--page", "raw",
        python, __file__, "--launch", json.dumps(cfg), "--calls", str(a.calls),
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, env=full_env, capture_output=True, text=True, check=False, timeout=a.timeout
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"ncu did not run to its end: {exc}") from exc
    # ncu's own complaints (no counter access, no kernel profiled) are ==ERROR== lines.
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith(("==ERROR==", "==WARNING=="))]
    if proc.returncode:
        raise RuntimeError(f"ncu exited {proc.returncode}: {said} {proc.stderr.strip()[-300:]}")
    try:
        return per_m(parse_ncu_csv(proc.stdout), MS, a.calls)
    except ValueError as exc:
        # The CSV's first lines go with the error, so that a format ncu changed can be read
        # from the results instead of guessed.
        head = [ln for ln in proc.stdout.splitlines() if not ln.startswith("==")][:3]
        raise ValueError(f"{exc}; ncu said {said}; CSV starts {head}") from exc


def report(payload: dict[str, Any], against: str) -> str:
    """Markdown: per configuration and arm, median kernel us per call / the base arm's, per M."""
    lines = [f"Kernel-only time per call, t(arm) / t(`{against}`), median of the rounds "
             f"({payload['method']}).", ""]  # fmt: skip
    if payload.get("host"):
        lines += [f"GPU: {payload['host']['gpu']}.", ""]
    if payload.get("command"):
        lines += [f"Command: `{payload['command']}`", ""]
    for row in payload["results"]:
        base = {int(m): us for m, us in row["median_us"].get(against, {}).items()}
        ms = sorted(base)
        heads, seps = ms_header(ms)
        lines += [
            f"### {label(row)}",
            "",
            f"| arm | {heads} |",
            f"|---|{seps}",
            f"| `{against}`, us | " + " | ".join(f"{base[m]:.2f}" for m in ms) + " |",
        ]
        for arm, med in row["median_us"].items():
            if arm == against:
                continue
            med = {int(m): us for m, us in med.items()}
            cells = [f"{med[m] / base[m]:.2f}" if m in med and base[m] else "-" for m in ms]
            lines.append(f"| `{arm}` | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def config(text: str) -> dict[str, Any]:
    """``K,N,bits,group_size,dtype`` into the bench's configuration dict."""
    K, N, bits, gs, dtype = text.split(",")
    return {"K": int(K), "N": int(N), "bits": int(bits), "group_size": int(gs), "dtype": dtype}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", action="append", default=[], help="NAME=PYTHON[:SITE]")
    ap.add_argument("--arm-env", action="append", default=[], help="NAME:KEY=VALUE")
    ap.add_argument("--config", action="append", type=config, default=[])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2, help="ncu runs per arm, alternating")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per ncu process")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--launch", help=argparse.SUPPRESS)
    ap.add_argument("--parse", type=Path, help="print what an ncu CSV parses to")
    ap.add_argument("--report", type=Path, help="a kernel-times JSON: ratio tables")
    ap.add_argument("--against", default="stock", help="--report's base arm")
    a = ap.parse_args()
    if a.launch:
        launch(json.loads(a.launch), MS, a.calls)
        return 0
    if a.report:
        print(report(json.loads(a.report.read_text()), a.against))
        return 0
    if a.parse:
        for name, us in parse_ncu_csv(a.parse.read_text()):
            print(f"{us:10.2f} us  {name}")
        return 0
    arms = parse_arms(a)
    payload: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "method": f"ncu --clock-control none --metrics {METRIC}: each kernel replayed once, "
        f"caches flushed; per M, {a.calls} calls after a marker kernel",
        "host": {"gpu": gpu_name()},
        "arm_env": {name: env for name, (_, _, env) in arms.items()},
        "results": [],
    }
    for cfg in a.config:
        row: dict[str, Any] = {**cfg, "arms": {name: [] for name in arms}}
        # Rounds in alternating arm order: drift in clocks or temperature between the
        # sequential ncu processes lands on every arm.
        for r in range(a.rounds):
            for name in list(arms) if r % 2 == 0 else list(reversed(arms)):
                try:
                    row["arms"][name].append(profile(arms[name], cfg, a))
                except (RuntimeError, ValueError) as exc:  # per arm, round and configuration
                    row["arms"][name].append({"error": str(exc)})
        row["median_us"] = {name: median_per_m(rounds) for name, rounds in row["arms"].items()}
        payload["results"].append(row)
        print(json.dumps(row), flush=True)
        if a.out:  # after every configuration: a stopped run keeps what it finished
            a.out.write_text(json.dumps(payload, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
