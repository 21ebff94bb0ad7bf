"""Turn a cuda_compiled_bench.py JSON into the committed markdown tables and plot (CPU only).

Usage: python scripts/cuda_compiled_report.py RESULTS.json [--against stock] [--arm NAME ...]
           [--versus A B ...] [--no-plot]
  -> RESULTS.md and RESULTS.png beside it (the plot needs the `plot` extra: matplotlib).

One run times every arm (an MLX build) per (configuration, M), so all ratios here are of
median per-call wall times from that one run. Every reported arm is read against one base
(`--against`, the stock wheel by default): its rows check, t(arm) / t(base) per M, and the
default-route summary. At M = 1 a build that leaves M = 1 alone runs stock's kernel, so the
spread of its M = 1 ratio is the run's noise (binding overhead, warm-up, clocks): ratios
inside it at M >= 2 say nothing either way. `--versus A B` puts two arms head to head
(t(A) / t(B)) without going through the base, and the "fastest per cell" table names, per
configuration and M, the arm a routing policy would pick. Summaries count only the
configurations whose call takes long enough to read: M = 1 >= MIN_US, the median of the arms'
M = 1 readings (every arm runs stock's M = 1 kernel, so one arm's stray reading, such as the
first configuration a fresh process meets, is disturbance, not the kernel). An arm may be
missing a configuration or have failed on it (`error`): it is then left out of every
comparison on that configuration, and the page says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

Row = dict[str, Any]
Key = tuple[Any, ...]

KEYS = ("K", "N", "bits", "group_size", "dtype")
DEFAULT_ROUTE = range(2, 8)  # M * B < 8 reaches qmv in stock MLX: the patch's default route
CANDIDATE_MS = range(2, 9)  # the default route and M = 8, the first M stock hands to qmm
MIN_US = 14.0  # below this per call, the M = 1 ratio (same kernel) strays past +-50 %
MAX_ERROR_CHARS = 160  # an error is quoted by its first line, cut here: the JSON has it whole


def key(cfg: Row) -> Key:
    """What makes two arms' rows the same configuration."""
    return tuple(cfg[k] for k in KEYS)


def label(cfg: Row) -> str:
    return f"{cfg['K']}x{cfg['N']} {cfg['bits']}-bit g{cfg['group_size']} {cfg['dtype']}"


def finished(data: dict[str, Any], arm: str) -> dict[Key, Row]:
    """The arm's rows that were timed, by configuration: failed rows (`error`) drop out here,
    so no comparison downstream can read a time that does not exist."""
    return {key(r): r for r in data["results"].get(arm, []) if "by_m" in r}


def times(row: Row) -> dict[int, float]:
    """Median per-call time by M (matched by M, not by position, so arms may differ in Ms)."""
    return {m["M"]: m["us"] for m in row["by_m"]}


def ratios(row: Row, other: Row) -> dict[int, float]:
    """t(row) / t(other) per M that both timed."""
    a, b = times(row), times(other)
    return {m: a[m] / b[m] for m in a if m in b}


def pairs(data: dict[str, Any], arm: str, base: str) -> list[tuple[Row, Row]]:
    """(arm row, base row) per configuration both arms finished, in the arm's order."""
    by_key = finished(data, base)
    return [(r, by_key[k]) for k, r in finished(data, arm).items() if k in by_key]


def differing(row: Row, m: int) -> int:
    """Rows at this M that differ from the arm's own M = 1 output: a fast cell that is not
    exact is not a candidate for an exact route, so the fastest-per-cell table flags it."""
    return next((x["rows_differing"] for x in row["by_m"] if x["M"] == m), 0)


def readable(base_row: Row) -> bool:
    """The M = 1 call is long enough that a ratio against it is more than dispatch: the
    median of the arms' M = 1 readings (``m1_median_us``, see :func:`with_m1_median`), or the
    row's own where that was not worked out."""
    return base_row.get("m1_median_us", times(base_row).get(1, 0.0)) >= MIN_US


def with_m1_median(data: dict[str, Any]) -> dict[str, Any]:
    """Each row gets ``m1_median_us``: the median of the M = 1 times the arms read for its
    configuration (in memory; the JSON stays as measured)."""
    rows = [r for arm_rows in data["results"].values() for r in arm_rows if "error" not in r]
    readings: dict[Key, list[float]] = {}
    for r in rows:
        if 1 in times(r):
            readings.setdefault(key(r), []).append(times(r)[1])
    for r in rows:
        if key(r) in readings:
            r["m1_median_us"] = statistics.median(readings[key(r)])
    return data


def configurations(data: dict[str, Any], arms: Iterable[str]) -> list[Row]:
    """Every configuration any of the arms ran (finished or not), first-seen order."""
    seen: dict[Key, Row] = {}
    for arm in arms:
        for r in data["results"].get(arm, []):
            seen.setdefault(key(r), r)
    return list(seen.values())


def span(xs: Sequence[float]) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


def ms_header(ms: Iterable[int]) -> tuple[str, str]:
    """The M columns of a table: header cells and their separator cells."""
    ms = list(ms)
    return " | ".join(f"M={m}" for m in ms), "---|" * len(ms)


def first_error(data: dict[str, Any], arm: str) -> str:
    """How many configurations the arm failed on, and the first error's first line."""
    errors = [r["error"] for r in data["results"].get(arm, []) if "error" in r]
    if not errors:
        return ""
    text = (str(errors[0]).strip().splitlines() or ["?"])[0]
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + "..."
    return f"; failed on {len(errors)} configuration(s), first: {text}"


def header(data: dict[str, Any], arms: list[str], base: str, source: str) -> list[str]:
    """What was run, where, with which builds and how it was timed."""
    state = "complete" if data.get("complete") else "partial: stopped before the end of its grid"
    n = len(configurations(data, [base, *arms]))
    title = ", ".join(f"`{a}`" for a in arms) or "nothing"
    lines = [
        f"# Compiled MLX on CUDA: {title} against `{base}`, side by side",
        "",
        f"Data: `{source}` ({state}, {n} configurations). GPU: {data['host'].get('gpu', '?')}.",
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
    for name in data["results"]:
        hello = data.get("arms", {}).get(name, {})
        env = " ".join(f"{k}={v}" for k, v in hello.get("env", {}).items()) or "default environment"
        note = "" if name == base or name in arms else " (not reported here)"
        # What an arm turned out to be, written into the JSON after the run ("annotations").
        said = data.get("annotations", {}).get(name)
        lines.append(
            f"- `{name}`: MLX {hello.get('mlx_version', '?')}, {env}{first_error(data, name)}{note}"
            + (f". {said}" if said else "")
        )
    # What was learnt about a run after it ran (a measurement artifact, say) travels in its
    # JSON as "caveats", so that every rendering of it carries them.
    caveats = [f"- {c}" for c in data.get("caveats", [])]
    method = [*lines, "", f"Method: {data['method']}."]
    return [*method, "", "Caveats:", *caveats] if caveats else method


def rows_table(data: dict[str, Any], arms: list[str], base: str) -> list[str]:
    """Exactness per arm: the claim for the patched builds, the negative control for stock."""
    names = [base, *arms]
    lines = [
        "## Rows",
        "",
        "Rows differing from the same arm's M = 1 output / rows compared (every M summed); "
        "0 is exact.",
        "",
        "| configuration | " + " | ".join(f"`{a}`" for a in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    rows = {a: {key(r): r for r in data["results"].get(a, [])} for a in names}
    for cfg in configurations(data, names):
        cells = []
        for a in names:
            r = rows[a].get(key(cfg))
            if r is None:
                cells.append("-")
            elif "by_m" not in r:
                cells.append("failed")
            else:
                differing = sum(m["rows_differing"] for m in r["by_m"])
                cells.append(f"{differing} / {sum(m['M'] for m in r['by_m'])}")
        lines.append(f"| {label(cfg)} | " + " | ".join(cells) + " |")
    return lines


def ratio_table(data: dict[str, Any], arm: str, base: str) -> list[str]:
    """t(arm) / t(base) at every M, configurations both finished."""
    ps = pairs(data, arm, base)
    lines = [f"### t(`{arm}`) / t(`{base}`)", ""]
    if not ps:
        return [*lines, f"No configuration finished in both `{arm}` and `{base}`."]
    ms = sorted(ratios(*ps[0]))
    head, sep = ms_header(ms)
    lines += [f"| configuration | t(M=1) `{base}`, us | {head} |", f"|---|---|{sep}"]
    for row, other in ps:
        r = ratios(row, other)
        cells = " | ".join(f"{r[m]:.2f}" if m in r else "-" for m in ms)
        t1 = times(other).get(1)
        lines.append(f"| {label(row)} | {'-' if t1 is None else f'{t1:.1f}'} | {cells} |")
    return lines


def versus(data: dict[str, Any], a: str, b: str, base: str) -> list[str]:
    """Two arms against each other directly, M = 2..8: which kernel to take, not which beats
    stock. The readable subset is judged by the M = 1 time, as everywhere else."""
    ps = pairs(data, a, b)
    base_rows = finished(data, base)
    lines = [f"### t(`{a}`) / t(`{b}`)", ""]
    if not ps:
        return [*lines, f"No configuration finished in both `{a}` and `{b}`."]
    head, sep = ms_header(CANDIDATE_MS)
    lines += [f"| configuration | {head} |", f"|---|{sep}"]
    every: list[float] = []
    large: list[float] = []
    n_large = 0
    for row, other in ps:
        r = ratios(row, other)
        lines.append(
            f"| {label(row)} | "
            + " | ".join(f"{r[m]:.2f}" if m in r else "-" for m in CANDIDATE_MS)
            + " |"
        )
        xs = [r[m] for m in CANDIDATE_MS if m in r]
        every += xs
        base_row = base_rows.get(key(row))
        if base_row is not None and readable(base_row):
            large += xs
            n_large += 1
    lines += [
        "",
        f"`{a}` faster (ratio < 1.00) in {sum(x < 1 for x in every)} of {len(every)} cells, "
        f"ratios {span(every)}; on the {n_large} configurations whose M = 1 call "
        f"takes >= {MIN_US:.0f} us: {sum(x < 1 for x in large)} of {len(large)}, "
        f"{span(large)}.",
    ]
    return lines


def readable_m1(ps: list[tuple[Row, Row]]) -> list[float]:
    """t(arm) / t(base) at M = 1 on the readable configurations: the run's noise, where
    both run stock's M = 1 kernel."""
    return [x[1] for r, o in ps if readable(o) and 1 in (x := ratios(r, o))]


def summary(ps: list[tuple[Row, Row]], arm: str, base: str) -> list[str]:
    """One arm against the base: the M = 1 spread (noise, where the arm leaves M = 1 to
    stock's kernel), then per default-route M the ratio range on the readable shapes."""
    by_pair = [(r, ratios(r, o), readable(o)) for r, o in ps]  # (arm row, per-M ratio, readable)
    large = [(r, x) for r, x, ok in by_pair if ok]
    m1 = [x[1] for _, x, _ in by_pair if 1 in x]
    m1_large = [x[1] for _, x in large if 1 in x]
    out = [
        f"### `{arm}` against `{base}`",
        "",
        f"- M = 1: t(`{arm}`) / t(`{base}`) spans {span(m1)} over all {len(ps)} "
        f"configurations and {span(m1_large)} over the {len(large)} whose M = 1 call "
        f"takes >= {MIN_US:.0f} us (the run's noise, where `{arm}` runs stock's M = 1 kernel).",
        "",
    ]
    if not large:
        return [*out, f"No configuration with M = 1 >= {MIN_US:.0f} us finished in both."]
    head, sep = ms_header(DEFAULT_ROUTE)
    out += [
        f"Default route (M = 2..7), configurations with M = 1 >= {MIN_US:.0f} us, "
        "ratio range and how many are above 1.00:",
        "",
        f"| bits | {head} |",
        f"|---|{sep}",
    ]
    for bits in sorted({r["bits"] for r, _ in large}):
        cells = []
        for m in DEFAULT_ROUTE:
            xs = [x[m] for r, x in large if r["bits"] == bits and m in x]
            cells.append(f"{span(xs)} ({sum(x > 1 for x in xs)}/{len(xs)})" if xs else "-")
        out.append(f"| {bits} | " + " | ".join(cells) + " |")
    return out


def by_size(ps: list[tuple[Row, Row]], arm: str, base: str) -> list[str]:
    """Where a floor on the layer size would go: per bit width, every configuration (small
    ones included: that is where a floor is read) by its weights n * k, the arm's worst
    t / t(base) over the default route's M = 2..7, and the smallest n * k from which every
    configuration is no slower than the base beyond the run's noise: the largest M = 1
    ratio on the readable shapes (at M = 1 both run stock's kernel), at least 1.00."""
    noise = max([1.0, *readable_m1(ps)])
    lines = [
        f"### `{arm}` by layer size",
        "",
        f"| bits | n * k | configuration | worst t(`{arm}`) / t(`{base}`), M = 2..7 | at M |",
        "|---|---|---|---|---|",
    ]
    verdicts = []
    for bits in sorted({r["bits"] for r, _ in ps}):
        rows = []
        for r, o in ps:
            x = ratios(r, o)
            route = [m for m in DEFAULT_ROUTE if m in x]
            if r["bits"] == bits and route:
                worst = max(route, key=lambda m, x=x: x[m])
                rows.append((r["N"] * r["K"], label(r), x[worst], worst))
        rows.sort()
        lines += [f"| {bits} | {nk:,} | {name} | {t:.2f} | {m} |" for nk, name, t, m in rows]
        floor = None  # the smallest n * k with every configuration from it up within the noise
        for nk, _, ratio, _ in reversed(rows):
            if ratio > noise:
                break
            floor = nk
        where = f"from n * k = {floor:,} up" if floor is not None else "at no size"
        verdicts.append(f"- {bits}-bit: every M = 2..7 within {noise:.2f} of `{base}` {where}.")
    head = (
        f"Within {noise:.2f}: the largest M = 1 ratio on the readable shapes, where both run "
        "stock's kernel (the run's noise). A small layer's wall time is mostly host work: read "
        "its kernel-only times beside this."
    )
    return [*lines, "", head, "", *verdicts]


def fastest(
    data: dict[str, Any], arms: list[str], base: str
) -> tuple[list[str], dict[str, int], dict[str, int]]:
    """Per readable configuration and M = 2..8, the arm with the lowest median time (the base
    included: where it wins, the policy keeps stock). The margin to the runner-up says whether
    the win is larger than the noise. Returns the table lines, the cells won per arm, and how
    many of those the arm won with rows that differ from its M = 1 output: a win no exact
    routing can take."""
    names = [base, *arms]
    done = {a: finished(data, a) for a in names}
    wins = dict.fromkeys(names, 0)
    inexact = dict.fromkeys(names, 0)
    head, sep = ms_header(CANDIDATE_MS)
    lines = [f"| configuration | {head} |", f"|---|{sep}"]
    for k, base_row in done[base].items():
        if not readable(base_row):
            continue
        cells = []
        for m in CANDIDATE_MS:
            if m not in times(base_row):
                cells.append("-")
                continue
            timed = [(times(done[a][k]), a) for a in names if k in done[a]]
            ranked = sorted(((t[m], a) for t, a in timed if m in t), key=lambda ta: ta[0])
            t, a = ranked[0]
            wins[a] += 1
            margin = f"{t / ranked[1][0]:.2f}" if len(ranked) > 1 else "-"
            flag = "*" if differing(done[a][k], m) else ""
            inexact[a] += bool(flag)
            cells.append(f"{a}{flag} {t / times(base_row)[m]:.2f} ({margin})")
        lines.append(f"| {label(base_row)} | " + " | ".join(cells) + " |")
    return lines, wins, inexact


def markdown(
    data: dict[str, Any],
    arms: Sequence[str],
    base: str,
    source: str,
    versus_pairs: Sequence[tuple[str, str]] = (),
) -> str:
    """The whole page: header, rows, per-arm ratios, head to head, summary, fastest per cell."""
    with_m1_median(data)
    arms = list(arms)
    lines = [*header(data, arms, base, source), "", *rows_table(data, arms, base)]
    lines += [
        "",
        f"## t(arm) / t(`{base}`) per M",
        "",
        "In a build that leaves M = 1 alone (ours does), M = 1 runs stock's kernel, so that "
        "column is the run's noise; M = 2..7 is the default route (stock: per-vector `qmv`); "
        "M >= 8 is the opt-in exact route (stock: `qmm`). Configurations both arms finished.",
    ]
    for arm in arms:
        lines += ["", *ratio_table(data, arm, base)]
    if versus_pairs:
        lines += [
            "",
            "## Head to head",
            "",
            "t(A) / t(B) per M = 2..8, configurations both finished; below 1.00: A is faster.",
        ]
        for a, b in versus_pairs:
            lines += ["", *versus(data, a, b, base)]
    lines += ["", "## Summary"]
    for arm in arms:
        lines += ["", *summary(pairs(data, arm, base), arm, base)]
    lines += ["", "## By layer size"]
    for arm in arms:
        lines += ["", *by_size(pairs(data, arm, base), arm, base)]
    table, wins, inexact = fastest(data, arms, base)
    won = ", ".join(
        f"{a} {n}" + (f" ({inexact[a]} with rows that differ)" if inexact[a] else "")
        for a, n in wins.items()
    )
    lines += [
        "",
        "## Fastest per cell",
        "",
        f"Configurations whose M = 1 call takes >= {MIN_US:.0f} us, M = 2..8 "
        "(M = 8: the first M stock hands to `qmm`). Cell: the arm with the lowest median time "
        f"among those that finished the configuration, its t / t(`{base}`), and in brackets its "
        "t / t(runner-up): near 1.00 is a tie within the noise; `*`: that arm's rows at this M "
        "differ from its M = 1 output (not exact).",
        "",
        *table,
        "",
        f"Cells won: {won} (of {sum(wins.values())}).",
    ]
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], arms: Sequence[str], base: str, path: Path) -> None:
    """Headline configurations (group 64, bfloat16): rows = bits, columns = arms, one line
    per shape, coloured the same in every panel so a shape can be followed across arms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(arms)
    if not arms:
        return
    shapes: list[tuple[int, int]] = []
    for cfg in configurations(data, [base, *arms]):
        if (cfg["K"], cfg["N"]) not in shapes:
            shapes.append((cfg["K"], cfg["N"]))
    bit_rows = (4, 8)
    fig, axes = plt.subplots(
        len(bit_rows),
        len(arms),
        figsize=(max(11.0, 4.2 * len(arms) + 1.5), 8),
        sharey=True,
        squeeze=False,
    )
    for i, bits in enumerate(bit_rows):
        for j, arm in enumerate(arms):
            ax = axes[i][j]
            for row, other in pairs(data, arm, base):
                if (row["bits"], row["group_size"], row["dtype"]) != (bits, 64, "bfloat16"):
                    continue
                r = ratios(row, other)
                ms = sorted(r)
                ax.plot(ms, [r[m] for m in ms], marker="o", ms=3,
                        color=f"C{shapes.index((row['K'], row['N'])) % 10}",
                        label=f"{row['K']}x{row['N']}")  # fmt: skip
            ax.axhline(1.0, color="k", lw=0.8)
            ax.axvspan(1.5, 7.5, color="tab:green", alpha=0.08, label="default route (M = 2..7)")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.set_title(f"{arm}: {bits}-bit, group 64, bfloat16", fontsize=10)
            if i == len(bit_rows) - 1:
                ax.set_xlabel("M (vectors per call)")
            if j == 0:
                ax.set_ylabel(f"t(arm) / t({base}), median per call")
    handles, names = axes[0][-1].get_legend_handles_labels()
    for ax in axes.flat:  # a panel may miss a shape; the legend lists every shape drawn
        for h, n in zip(*ax.get_legend_handles_labels(), strict=True):
            if n not in names:
                handles.append(h)
                names.append(n)
    # Below the panels, so it hides no line in the default route.
    fig.legend(handles, names, loc="lower center", ncol=len(names), fontsize=8, frameon=False)
    fig.suptitle(f"Compiled MLX on {data['host'].get('gpu', 'CUDA')}: each arm vs {base}")
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--against", default="stock", help="the base arm (default: stock)")
    ap.add_argument(
        "--arm", action="append", help="an arm to report, repeatable (default: all but the base)"
    )
    ap.add_argument(
        "--versus", action="append", nargs=2, metavar=("A", "B"), default=[],
        help="a head-to-head pair, t(A) / t(B); repeatable",
    )  # fmt: skip
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(argv)
    data = json.loads(a.results.read_text())
    present = list(data["results"])
    arms = a.arm if a.arm is not None else [n for n in present if n != a.against]
    pairs_ = [(p[0], p[1]) for p in a.versus]
    for name in [a.against, *arms, *(n for p in pairs_ for n in p)]:
        if name not in present:
            ap.error(f"no arm {name!r} in {a.results.name} (arms: {', '.join(present)})")
    if a.against in arms:
        ap.error(f"--arm {a.against!r} is the base (--against)")
    page = markdown(data, arms, a.against, a.results.name, pairs_)
    a.results.with_suffix(".md").write_text(page)
    if not a.no_plot:
        plot(data, arms, a.against, a.results.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
