"""Turn a cuda_h200.py JSON into the committed markdown table and plot (CPU only).

Usage: python scripts/cuda_report.py RESULTS.json  -> RESULTS.md, RESULTS.png beside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ARM = "v248"  # the vector set the table reports (V = 2, 4, 8; M > 8 as M tiles of 8)
HEADLINE = {"K": 8192, "N": 28672}


def _fmt_cfg(c: dict[str, Any]) -> str:
    return f"{c['K']}x{c['N']} {c['bits']}-bit g{c['group_size']} {c['dtype']}"


def parity_table(results: list[dict[str, Any]]) -> list[str]:
    """One row per config: rows differing, summed over M = 1..16, per arm."""
    lines = [
        "| config (KxN) | JIT M=1 copy | streamed V=2..5 | V=2,4,8 | V=8 | V=16 "
        "| MLX batched, M>=8 (control) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r["parity"]
        arms = [
            sum(v[1] for v in p[f"streamed_{k}"].values()) for k in ("render", "v248", "v8", "v16")
        ]
        ctrl = sum(v[0] for m, v in p["batched_control"].items() if int(m) >= 8)
        copy = sum(p["jit_m1_copy"].values())
        cells = " | ".join(f"{a}/136" for a in arms)
        lines.append(f"| {_fmt_cfg(r['config'])} | {copy}/136 | {cells} | {ctrl}/108 differ |")
    return lines


def timing_table(r: dict[str, Any]) -> list[str]:
    """Per M: the three arms (us), streamed / its own M=1, and weight bandwidth fractions."""
    t = r["timing"]
    t1 = t["1"][f"streamed_{ARM}_us"]
    lines = [
        f"**{_fmt_cfg(r['config'])}** (weights+scales+biases {r['weight_bytes'] / 1e6:.1f} MB, "
        f"{r['weight_copies']} rotating copies)",
        "",
        "| M | V | streamed us | x its M=1 | M x M=1 calls us | MLX batched us | streamed/batched "
        "| streamed BW | batched BW |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, row in t.items():
        s = row[f"streamed_{ARM}_us"]
        lines.append(
            f"| {m} | {row[f'streamed_{ARM}_V']} | {s:.1f} | {s / t1:.2f} "
            f"| {row['separate_m1_us']:.1f} "
            f"| {row['batched_us']:.1f} | {s / row['batched_us']:.2f} "
            f"| {row[f'streamed_{ARM}_bw_frac']:.0%} | {row['batched_bw_frac']:.0%} |"
        )
    return lines


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Time vs M for the three arms on the timed 8192x28672 configs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = [r for r in results if "timing" in r and r["config"]["N"] == HEADLINE["N"]]
    fig, axes = plt.subplots(1, len(heads), figsize=(5 * len(heads), 4), squeeze=False)
    for ax, r in zip(axes[0], heads, strict=True):
        ms = [int(m) for m in r["timing"]]
        rows = list(r["timing"].values())
        ax.plot(ms, [x[f"streamed_{ARM}_us"] for x in rows], "o-", label="streamed (JIT, exact)")
        ax.plot(
            ms, [x["separate_m1_us"] for x in rows], "s--", label="M separate M=1 calls (exact)"
        )
        ax.plot(ms, [x["batched_us"] for x in rows], "^-", label="MLX batched (rows differ M>=8)")
        ax.set_title(_fmt_cfg(r["config"]), fontsize=9)
        ax.set_xlabel("M (vectors)")
        ax.set_ylabel("us per call (GPU-bound, median)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("MLX 0.32.1 CUDA quantized matmul on one H200: time vs M", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    src = Path(sys.argv[1])
    data = json.loads(src.read_text())
    results = data["results"]
    md = ["## Parity (rows differing from MLX's compiled M = 1 call, all M = 1..16)", ""]
    md += parity_table(results)
    md += ["", "## Timing", ""]
    for r in results:
        if "timing" in r:
            md += [*timing_table(r), ""]
    src.with_suffix(".tables.md").write_text("\n".join(md) + "\n")
    plot(results, src.with_suffix(".png"))


if __name__ == "__main__":
    main()
