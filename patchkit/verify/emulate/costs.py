"""The Metal PR's tile in optimized IR, per patched M = 1 kernel at V = 1, 2 and 5: the
arrays left in thread memory, the static loads of packed weights and the floating-point
words live at once, with upstream's ``qmv_wide`` beside it at the same V.

A proxy (x86 clang -O2 over patchkit's Metal shim, not Apple's GPU compiler; live words
are a lower bound on registers before any spill decision), in two settings, since what
stays in memory depends on them: clang's defaults, and every call of MLX's source inlined
with loops of fixed trip count unrolled, as GPU compilers do (``ir.INLINE_ALL``). One type
of each width (float and float16_t: bfloat16_t's IR has float16_t's shape), group 64 for
the affine kernels (the group size only changes a loop's trip count), unbatched.
``patchkit emulate --costs`` prints it; ``bench/metal_ir_costs.py`` keeps the page.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path
from typing import Any

from patchkit.verify import emulate
from patchkit.verify.emulate import ir
from patchkit.verify.emulate.families import AFFINE, FP

VECS = (1, 2, 5)
# The proxy's two settings, by the name rows and page give them: whether every call is
# inlined and fixed loops unrolled (ir.costs' ``inlined_unrolled``).
PROXIES = {"clang -O2": False, "inlined, unrolled": True}


def chosen(header: Any) -> list[ir.Instance]:
    """The instances the page covers (see the module's docstring)."""
    return [
        i
        for i in ir.instances(header)
        if i.args[0] in ("float", "float16_t")
        and i.args[3] == "false"
        and (header is FP or i.args[1] == "64")
    ]


def collect(root: Path) -> dict[str, Any]:
    """Every chosen instance in both settings, as the page's JSON (no command: the caller
    says how it was run)."""
    inputs = {}  # header -> (the patched sources, the pin's types): read once, both settings
    for header in (AFFINE, FP):
        upstream, types = emulate.pinned_sources(root, header)
        inputs[header] = (emulate.sources(upstream, header), types)
    rows = []
    for proxy, inlined_unrolled in PROXIES.items():
        for header, (sources, types) in inputs.items():
            for c in ir.costs(
                sources,
                header,
                types,
                chosen(header),
                VECS,
                wide=header is AFFINE,
                inlined_unrolled=inlined_unrolled,
            ):
                rows.append({
                    "proxy": proxy, "kernel": c.kernel, "instance": c.instance.label,
                    "vecs": c.vecs, "thread_arrays": list(c.arrays),
                    "weight_loads": c.weight_loads, "live_words": c.live_words,
                })  # fmt: skip
    version = subprocess.run(["clang++", "--version"], capture_output=True, text=True, check=True)
    return {
        "compiler": version.stdout.splitlines()[0],
        "flags": {proxy: list(ir.compile_flags(on, costs=True)) for proxy, on in PROXIES.items()},
        "host": f"{platform.system()} {platform.machine()}",
        "rows": rows,
    }


def page(report: dict[str, Any]) -> str:
    """Per proxy setting, one row per kernel instance: live words at each V, thread arrays
    at V = 1 and the largest V, weight loads, and upstream's qmv_wide beside it."""
    lines = [
        "# The Metal PR's tile in optimized IR (a proxy for Apple's compiler)",
        "",
        f"- Command: `{report['command']}`",
        f"- Compiler: {report['compiler']} over the Metal shim, {report['host']}, in two"
        " settings: clang's defaults, and every call of MLX's source inlined with the inline"
        " and unroll thresholds raised (GPU compilers inline every call and unroll loops of"
        " fixed trip count; which arrays stay in thread memory depends on both).",
        "- Live words: the most floating-point 32-bit words whose values are live at one"
        " point of the optimized kernel (half types count 1/2): a lower bound on registers"
        " before spilling. Thread arrays: float elements of each array left in thread"
        " memory. Weight loads: static loads whose address derives from the kernel's"
        " packed-weight argument `w` (the shim's half types load as 16-bit integers, so"
        " integer loads alone would count x, scales and biases too).",
        "- What only a GPU settles: registers, spills and occupancy as Apple's compiler"
        " makes them, and the time (`patchkit mac-report` on a Mac).",
    ]
    for proxy in PROXIES:
        by: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
        for r in report["rows"]:
            if r["proxy"] == proxy:
                by.setdefault((r["instance"], r["kernel"]), {})[r["vecs"]] = r
        lines += ["", f"## {proxy}: `{' '.join(report['flags'][proxy])}`", "", *observations(by)]
        lines += ["", *table(by)]
    return "\n".join(lines) + "\n"


def table(by: dict[tuple[str, str], dict[int, dict[str, Any]]]) -> list[str]:
    """One setting's table."""
    top = max(VECS)
    lines = [
        "| kernel (M = 1 instance) | live words V = 1 / 2 / 5 | thread arrays V = 1; V = 5 |"
        " weight loads V = 1 / 2 / 5 | qmv_wide V = 2 / 5: live words; arrays at 5 |",
        "|---|---|---|---|---|",
    ]
    for (inst, kernel), at in sorted(by.items()):
        if kernel != "patched":
            continue
        wide = by.get((inst, "qmv_wide"), {})
        live = " / ".join(f"{at[v]['live_words']:g}" for v in VECS)
        loads = " / ".join(str(at[v]["weight_loads"]) for v in VECS)
        arrays = "; ".join(_arrays(at[v]) for v in (1, top))
        wide_cell = ""
        if wide:
            wide_cell = " / ".join(f"{wide[v]['live_words']:g}" for v in VECS if v in wide)
            wide_cell += f"; {_arrays(wide[top])}"
        lines.append(f"| `{inst}` | {live} | {arrays} | {loads} | {wide_cell} |")
    return lines


def _arrays(row: dict[str, Any]) -> str:
    return ", ".join(map(str, row["thread_arrays"])) or "none"


def observations(by: dict[tuple[str, str], dict[int, dict[str, Any]]]) -> list[str]:
    """A few counts over the table, computed (the page states no number of its own)."""
    top = max(VECS)
    patched = {i: at for (i, k), at in by.items() if k == "patched"}
    wide = {i: at for (i, k), at in by.items() if k == "qmv_wide"}
    beyond = [i for i, at in patched.items() if sum(at[top]["thread_arrays"]) > top * 4]
    fast = [i for i in beyond if "_qmv_fast<" in i]
    at_one = [i for i in beyond if sum(patched[i][1]["thread_arrays"]) > 4]
    worst = max(patched, key=lambda i: patched[i][top]["live_words"])
    left = [i for i, at in patched.items() if at[top]["thread_arrays"]]
    left_at_one = [i for i in left if patched[i][1]["thread_arrays"]]
    out = [
        f"- Instances whose arrays in thread memory at V = {top} hold more than the {top} x 4"
        f" partial sums (input vectors kept in memory, not registers): {len(beyond)} of"
        f" {len(patched)} ({len(fast)} of them `qmv_fast`); {len(at_one)} of these keep more"
        " than 4 floats in memory at V = 1 too, where the kernel is upstream's.",
        f"- Instances with any array left in thread memory at V = {top}: {len(left)} of"
        f" {len(patched)}; {len(left_at_one)} of these keep one at V = 1 too, where the kernel"
        " is upstream's.",
        f"- Most live words at V = {top}: {patched[worst][top]['live_words']:g} (`{worst}`).",
    ]
    pair = VECS[1]  # growth from the smallest tile on (the line below says why)
    grown = [i for i, at in patched.items() if at[top]["weight_loads"] > at[pair]["weight_loads"]]
    families = sorted({i.split("<")[0] for i in patched})
    per_family = ", ".join(
        f"`{f}` {sum(i.split('<')[0] == f for i in grown)} of"
        f" {sum(i.split('<')[0] == f for i in patched)}"
        for f in families
    )
    out.append(
        f"- Instances with more weight loads at V = {top} than at V = {pair} (the V copies of"
        f" a block's loads not merged into one): {len(grown)} of {len(patched)}; {per_family}."
        " V = 1 (upstream's kernel) is not the reference: its last K block's guarded"
        " helpers loop to a run-time length, one load per trip, where a tile of vectors"
        " passes them the constant it then is and they unroll."
    )
    if wide:
        w = max(wide, key=lambda i: wide[i][top]["live_words"])
        in_memory = sum(bool(at[top]["thread_arrays"]) for at in wide.values())
        out.append(
            f"- Upstream's `qmv_wide` at V = {top}: at most {wide[w][top]['live_words']:g} live"
            f" words; arrays in thread memory in {in_memory} of {len(wide)}."
        )
    return out
