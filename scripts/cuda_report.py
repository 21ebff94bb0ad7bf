"""Turn a cuda_h200.py JSON into the committed markdown table and plot (CPU only).

Usage: python scripts/cuda_report.py RESULTS.json  -> RESULTS.md, RESULTS.png beside it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ARM = "v248"  # the `global` run's headline V set (V = 2, 4, 8; M > 8 in tiles of 8)
SHIPPED = "smem_v24_w2_pf_async_4warps"  # the arm that runs what patches/ renders
HEADLINE = {"K": 8192, "N": 28672}
# Column names of the streamed arms cuda_h200.py knows; others show their label.
ARM_NAMES = {
    "render": "global V=2..5",
    "v248": "V=2,4,8",
    "v8": "V=8",
    "v16": "V=16",
    "v24816": "V=2,4,8,16",
    "smem_render": "smem V=2..5",
    "smem_v248": "smem V=2,4,8",
    "smem_v8": "smem V=8",
    "smem16_render": "smem 16 rows V=2..5",
    "smem_s1_render": "smem 1 step/stage V=2..5",
    "smem_v248_w2": "smem 2 rows/warp V=2,4,8",
    "smem_v24_w2": "smem 2 rows/warp V=2,4",
    "smem_v24_w4": "smem 4 rows/warp V=2,4",
    "smem_v2_w4": "smem 4 rows/warp V=2",
    "smem_s1_v24_w2": "smem 1 step/stage 2 rows/warp V=2,4",
    "smem_v248_pf": "smem+L2 V=2,4,8",
    "smem_v8_pf": "smem+L2 V=8",
    "smem_v24_pf": "smem+L2 V=2,4",
    "smem_v24_w2_pf": "smem+L2 2 rows/warp V=2,4",
    "smem_v24_w4_pf": "smem+L2 4 rows/warp V=2,4",
    "smem_v24_w2_pf_4warps": "smem+L2 4 warps x 2 rows V=2,4",
    "smem_v248_w2_pf_4warps": "smem+L2 4 warps x 2 rows V=2,4,8",
    SHIPPED: "shipped: async+L2 4 warps x 2 rows V=2,4",
    "smem_v24_w2_async_4warps": "async 4 warps x 2 rows V=2,4",
    "smem_v248_pf_async": "async+L2 8 warps V=2,4,8",
    "smem_v248_w2_pf_async_4warps": "async+L2 4 warps x 2 rows V=2,4,8",
}
OLD_PARITY_ARMS = ["render", "v248", "v8", "v16"]  # the 2026-11-29 table's columns


def _fmt_cfg(c: dict[str, Any]) -> str:
    return f"{c['K']}x{c['N']} {c['bits']}-bit g{c['group_size']} {c['dtype']}"


def _arms(record: dict[str, Any], prefix: str = "streamed_", suffix: str = "") -> list[str]:
    """Streamed arm labels in a parity dict or timing row, in the order they ran."""
    return [
        k[len(prefix) : len(k) - len(suffix)]
        for k in record
        if k.startswith(prefix) and k.endswith(suffix)
    ]


def parity_table(results: list[dict[str, Any]]) -> list[str]:
    """One row per config: rows differing, summed over M = 1..16, per arm."""
    labels = _arms(results[0]["parity"]) if results else OLD_PARITY_ARMS
    names = " | ".join(ARM_NAMES.get(k, k) for k in labels)
    lines = [
        f"| config (KxN) | JIT M=1 copy | {names} | MLX batched, M>=8 (control) |",
        "|---|---|" + "---|" * len(labels) + "---|",
    ]
    for r in results:
        p = r["parity"]
        arms = [sum(v[1] for v in p[f"streamed_{k}"].values()) for k in labels]
        ctrl = sum(v[0] for m, v in p["batched_control"].items() if int(m) >= 8)
        copy = sum(p["jit_m1_copy"].values())
        cells = " | ".join(f"{a}/136" for a in arms)
        lines.append(f"| {_fmt_cfg(r['config'])} | {copy}/136 | {cells} | {ctrl}/108 differ |")
    return lines


def timing_table(r: dict[str, Any], arm: str = ARM) -> list[str]:
    """Per M: the three arms (us), streamed / its own M=1, and weight bandwidth fractions."""
    t = r["timing"]
    if f"streamed_{arm}_us" not in t["1"]:
        arm = SHIPPED if f"streamed_{SHIPPED}_us" in t["1"] else _arms(t["1"], suffix="_us")[0]
    t1 = t["1"][f"streamed_{arm}_us"]
    lines = [
        f"**{_fmt_cfg(r['config'])}** (weights+scales+biases {r['weight_bytes'] / 1e6:.1f} MB, "
        f"{r['weight_copies']} rotating copies)",
        "",
        f"Streamed arm: {ARM_NAMES.get(arm, arm)}.",
        "",
        "| M | V | streamed us | x its M=1 | M x M=1 calls us | MLX batched us | streamed/batched "
        "| streamed BW | batched BW |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m, row in t.items():
        s = row[f"streamed_{arm}_us"]
        lines.append(
            f"| {m} | {row[f'streamed_{arm}_V']} | {s:.1f} | {s / t1:.2f} "
            f"| {row['separate_m1_us']:.1f} "
            f"| {row['batched_us']:.1f} | {s / row['batched_us']:.2f} "
            f"| {row[f'streamed_{arm}_bw_frac']:.0%} | {row['batched_bw_frac']:.0%} |"
        )
    return lines


def comparison_table(r: dict[str, Any]) -> list[str]:
    """Per M: every streamed arm side by side (us), plus the stock arms; then the slope.

    The slope is (t(M=5) - t(M=1)) / 4: the cost of one added vector, which was
    ~115-125 us on 8192x28672 4-bit with x read from global memory.
    """
    t = r["timing"]
    labels = _arms(t["1"], suffix="_us")
    head = " | ".join(f"{ARM_NAMES.get(k, k)} us" for k in labels)
    lines = [
        f"**{_fmt_cfg(r['config'])}**, all arms",
        "",
        f"| M | {head} | M x M=1 calls us | MLX batched us | JIT qmv copy us |",
        "|---|" + "---|" * (len(labels) + 3),
    ]
    for m, row in t.items():
        cells = " | ".join(f"{row[f'streamed_{k}_us']:.1f}" for k in labels)
        lines.append(
            f"| {m} | {cells} | {row['separate_m1_us']:.1f} | {row['batched_us']:.1f} "
            f"| {row['jit_qmv_copy_us']:.1f} |"
        )
    if "1" in t and "5" in t:
        slopes = " | ".join(
            f"{(t['5'][f'streamed_{k}_us'] - t['1'][f'streamed_{k}_us']) / 4:.1f}" for k in labels
        )
        sep = (t["5"]["separate_m1_us"] - t["1"]["separate_m1_us"]) / 4
        lines.append(f"| us per added vector (M=1..5) | {slopes} | {sep:.1f} | | |")
    return lines


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Time vs M for the three arms on the timed 8192x28672 configs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = [r for r in results if "timing" in r and r["config"]["N"] == HEADLINE["N"]]
    if not heads:  # a parity-only run: nothing to plot
        return
    fig, axes = plt.subplots(1, len(heads), figsize=(5 * len(heads), 4), squeeze=False)
    for ax, r in zip(axes[0], heads, strict=True):
        ms = [int(m) for m in r["timing"]]
        rows = list(r["timing"].values())
        labels = _arms(rows[0], suffix="_us")
        if not any(k.startswith("smem") for k in labels):
            labels = [ARM]  # the 2026-11-29 plot: one streamed arm
        for k in labels:
            name = "streamed (JIT, exact)" if k == ARM else f"{ARM_NAMES.get(k, k)} (JIT)"
            ax.plot(ms, [x[f"streamed_{k}_us"] for x in rows], "o-", label=name)
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
    if data.get("variant", "global") != "global":
        md += ["## All streamed arms side by side", ""]
        for r in results:
            if "timing" in r:
                md += [*comparison_table(r), ""]
    src.with_suffix(".tables.md").write_text("\n".join(md) + "\n")
    plot(results, src.with_suffix(".png"))


if __name__ == "__main__":
    main()
