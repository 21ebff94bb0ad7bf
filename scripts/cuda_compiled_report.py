"""Turn a cuda_compiled_bench.py JSON into the committed markdown tables and plot (CPU only).

Usage: python scripts/cuda_compiled_report.py RESULTS.json [--against stock] [--arm patched]
  -> RESULTS.md and RESULTS.png beside it (the plot needs the `plot` extra: matplotlib).

The ratio t(arm) / t(stock) of the median per-call wall time, per (configuration, M),
all from one run. At M = 1 every arm runs the same stock kernel, so the spread of the
M = 1 column is the run's noise (binding overhead, warm-up, clocks): ratios inside it
at M >= 2 say nothing either way. The summary counts, per M of the default route,
the configurations whose call takes long enough to read (stock M = 1 >= MIN_US).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

KEYS = ("K", "N", "bits", "group_size", "dtype")
DEFAULT_ROUTE = range(2, 8)  # M * B < 8 reaches qmv in stock MLX: the patch's default route


def label(cfg: dict[str, Any]) -> str:
    return f"{cfg['K']}x{cfg['N']} {cfg['bits']}-bit g{cfg['group_size']} {cfg['dtype']}"


def pairs(data: dict[str, Any], arm: str, base: str) -> list[tuple[dict, dict]]:
    """(arm row, base row) per configuration both arms finished without error."""
    by_key = {tuple(r[k] for k in KEYS): r for r in data["results"][base] if "by_m" in r}
    out = []
    for r in data["results"][arm]:
        other = by_key.get(tuple(r[k] for k in KEYS))
        if "by_m" in r and other:
            out.append((r, other))
    return out


def readings(row: dict[str, Any], base: dict[str, Any]) -> list[dict[str, float]]:
    """Per M: the ratio of the medians."""
    return [
        {"M": a["M"], "ratio": a["us"] / b["us"]}
        for a, b in zip(row["by_m"], base["by_m"], strict=True)
    ]


MIN_US = 14.0  # below this per call, the M = 1 ratio (same kernel) strays past +-50 %


def summary(ps: list[tuple[dict, dict]], arm: str, base: str) -> list[str]:
    """Noise from the M = 1 column, then per default-route M the ratio range, large shapes."""
    large = [(r, o) for r, o in ps if o["by_m"][0]["us"] >= MIN_US]
    m1 = [readings(r, o)[0]["ratio"] for r, o in ps]
    m1_large = [readings(r, o)[0]["ratio"] for r, o in large]
    out = [
        "## Summary",
        "",
        f"- Noise: at M = 1 (the same kernel in both builds) t(`{arm}`) / t(`{base}`) spans "
        f"{min(m1):.2f}-{max(m1):.2f} over all configurations and "
        + (f"{min(m1_large):.2f}-{max(m1_large):.2f}" if m1_large else "-")
        + f" over the {len(large)} whose stock M = 1 call takes >= {MIN_US:.0f} us.",
        "",
        f"Default route (M = 2..7), configurations with stock M = 1 >= {MIN_US:.0f} us, "
        "ratio range and how many are above 1.00:",
        "",
        "| bits | " + " | ".join(f"M={m}" for m in DEFAULT_ROUTE) + " |",
        "|---|" + "---|" * len(DEFAULT_ROUTE),
    ]
    for bits in sorted({r["bits"] for r, _ in large}):
        cells = []
        for m in DEFAULT_ROUTE:
            xs = [readings(r, o)[m - 1]["ratio"] for r, o in large if r["bits"] == bits]
            cells.append(f"{min(xs):.2f}-{max(xs):.2f} ({sum(x > 1 for x in xs)}/{len(xs)})")
        out.append(f"| {bits} | " + " | ".join(cells) + " |")
    return out


def markdown(data: dict[str, Any], arm: str, base: str, source: str) -> str:
    ps = pairs(data, arm, base)
    ms = [m["M"] for m in ps[0][0]["by_m"]] if ps else []
    state = "complete" if data.get("complete") else "partial: stopped by its deadline"
    lines = [
        f"# Compiled MLX on CUDA: `{arm}` against `{base}`, side by side",
        "",
        f"Data: `{source}` ({state}, {len(ps)} configurations). "
        f"GPU: {data['host'].get('gpu', '?')}.",
        "",
        f"Command: `{data['command']}`"
        + (
            " (`$WORK`: `scripts/cuda_build_device.sh`'s work folder on the GPU host)"
            if "$WORK" in data["command"]
            else ""
        ),
        "",
        "Arms:",
    ]
    for name, hello in data["arms"].items():
        env = " ".join(f"{k}={v}" for k, v in hello.get("env", {}).items()) or "default environment"
        lines.append(f"- `{name}`: MLX {hello['mlx_version']}, {env}")
    lines += [
        "",
        f"Method: {data['method']}.",
        "",
        "## Rows",
        "",
        "| configuration | rows differing from M = 1, `" + arm + "` | same, `" + base + "` |",
        "|---|---|---|",
    ]
    for row, other in ps:
        a = sum(m["rows_differing"] for m in row["by_m"])
        b = sum(m["rows_differing"] for m in other["by_m"])
        rows = sum(m["M"] for m in row["by_m"])
        lines.append(f"| {label(row)} | {a} / {rows} | {b} / {rows} |")
    lines += [
        "",
        f"## t(`{arm}`) / t(`{base}`) per M",
        "",
        "M = 1 runs the same stock kernel in both builds; M = 2..7 is the default route "
        "(stock: per-vector `qmv`); M >= 8 is the opt-in exact route (stock: `qmm`).",
        "",
        "| configuration | t(M=1) stock, us | " + " | ".join(f"M={m}" for m in ms) + " |",
        "|---|---|" + "---|" * len(ms),
    ]
    for row, other in ps:
        r = readings(row, other)
        cells = " | ".join(f"{x['ratio']:.2f}" for x in r)
        lines.append(f"| {label(row)} | {other['by_m'][0]['us']:.1f} | {cells} |")
    lines += ["", *summary(ps, arm, base)]
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], arm: str, base: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ps = [(r, o) for r, o in pairs(data, arm, base) if r["group_size"] == 64]
    ps = [(r, o) for r, o in ps if r["dtype"] == "bfloat16"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, bits in zip(axes, (4, 8), strict=True):
        for row, other in (p for p in ps if p[0]["bits"] == bits):
            r = readings(row, other)
            ax.plot([x["M"] for x in r], [x["ratio"] for x in r], marker="o", ms=3,
                    label=f"{row['K']}x{row['N']}")  # fmt: skip
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axvspan(1.5, 7.5, color="tab:green", alpha=0.08, label="default route (M = 2..7)")
        ax.set_yscale("log")
        ax.set_xlabel("M (vectors per call)")
        ax.set_title(f"{bits}-bit, group 64, bfloat16")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"t({arm}) / t({base}), median per call")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"Compiled MLX on {data['host'].get('gpu', 'CUDA')}: {arm} vs {base}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", type=Path)
    ap.add_argument("--arm", default="patched")
    ap.add_argument("--against", default="stock")
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args()
    data = json.loads(a.results.read_text())
    a.results.with_suffix(".md").write_text(markdown(data, a.arm, a.against, a.results.name))
    if not a.no_plot:
        plot(data, a.arm, a.against, a.results.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
