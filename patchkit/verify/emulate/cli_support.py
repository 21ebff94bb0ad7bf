"""What ``patchkit emulate`` computes, shaped for printing; cli.py only prints it.

Kept out of cli.py because it is not terminal code: it validates a case,
runs the suite and builds the JSON payload and the human summary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patchkit.errors import UserError
from patchkit.verify import emulate
from patchkit.verify.emulate import build, ir, parity, suite
from patchkit.verify.emulate.families import AFFINE, FAMILIES, FP_MODES, Header, modes_of


def _toolchains(choice: str) -> list[str]:
    if choice == "all":
        return list(build.GATE)
    return ["gcc", "clang"] if choice == "both" else [choice]


def validate_case(opts: dict[str, Any]) -> parity.Case:
    """A Case from CLI options (``--mode`` all means affine), or a one-line UserError."""
    mode = "affine" if opts.get("mode", "all") == "all" else opts["mode"]
    if mode not in FAMILIES:
        raise UserError("--kernel checks one mode: choose --mode affine, mxfp4, nvfp4 or mxfp8")
    family = FAMILIES[mode]
    missing = [f"-{k}" for k in ("K", "N") if opts.get(k) is None]
    if missing:
        raise UserError(f"--kernel checks one case: give {' and '.join(missing)}")
    bits, gs = family.bits[0], family.group_sizes[0]
    if len(family.bits) > 1:  # --bits and --group-size choose among the mode's
        bits, gs = opts["bits"], opts["group_size"]
        if bits not in family.bits:
            raise UserError(f"unsupported --bits {bits}; choose from {list(family.bits)}")
        if gs not in family.group_sizes:
            raise UserError(
                f"unsupported --group-size {gs}; choose from {list(family.group_sizes)}"
            )
    K, N, M, B = opts["K"], opts["N"], opts["M"], opts["B"]
    if K <= 0 or N <= 0 or M < 1 or B < 1:
        raise UserError("-K, -N, -M and -B must be positive")
    if K % gs:
        of = "--group-size" if len(family.group_sizes) > 1 else f"{mode}'s group size"
        raise UserError(f"-K {K} is not a multiple of {of} {gs}")
    # --global-scale and --narrow select fp variants (Case refuses them off nvfp4).
    hgs, rps = (
        (opts["global_scale"], 2 if opts["narrow"] else 4) if mode in FP_MODES else (False, 4)
    )
    if K in (64, 128) and not hgs:
        raise UserError(f"-K {K} runs qmv_quad in MLX, which this kernel does not replace")
    return parity.Case(mode, K, N, opts["dtype"], M, B, hgs, rps, bits=bits, group_size=gs)


def _sources(
    root: Path,
    family: Header,
    header: Path | None,
    opts: dict[str, Any],
    say: Callable[[str], None],
) -> tuple[emulate.Sources, tuple[str, ...]]:
    """``family``'s kernel header, upstream and patched, and its type headers (``--header``…)."""
    say(f"reading the pinned {family.name} header")
    path = header if family is AFFINE else opts.get("fp_header")
    upstream, types = emulate.pinned_sources(root, family, path)
    return emulate.sources(upstream, family), types


def _every_tenth(say: Callable[[str], None], what: str) -> Callable[[int, int], None]:
    """A progress callback that speaks at each tenth of the cases, with the time left.

    Piped output (CI logs) gets one line per step; a terminal spinner loses nothing.
    """
    start = time.monotonic()

    def report(i: int, n: int) -> None:
        if i == n or i % max(1, n // 10) == 0:
            left = (time.monotonic() - start) * (n - i) / i
            say(f"{what}: case {i}/{n}" + (f", about {left:.0f} s left" if i < n else ""))

    return report


def ir_identity(
    family: Header,
    sources: emulate.Sources,
    types: tuple[str, ...],
    say: Callable[[str], None],
) -> tuple[dict[str, Any], str, bool]:
    """Every M = 1 kernel of ``family`` at vecs_per_tg = 1 against upstream's (:mod:`.ir`)."""
    say(f"compiling {family.name}'s M = 1 kernels, upstream and patched (clang -O2)")
    pairs = ir.compare(sources, family, types)
    differing = [p.instance.label for p in pairs if not p.identical]
    payload = {"instances": len(pairs), "differing": differing, "ok": not differing}
    line = (
        f"{family.name} M = 1 unchanged: {len(pairs) - len(differing)} of {len(pairs)} kernel "
        "instances compile to upstream's optimized IR at vecs_per_tg = 1"
    )
    return payload, line + "".join(f"\n  differs: {d}" for d in differing), not differing


def case_summary(
    label: str, kernel: str, results: list[tuple[str, parity.Result]]
) -> tuple[dict[str, Any], str, bool]:
    """JSON payload, human lines and verdict of one case run with each toolchain.

    For the control (``--kernel wide``) divergence is the expected outcome, so
    it never fails the command.
    """
    identical = all(r.identical for _, r in results)
    payload = {
        **results[0][1].as_dict(),
        "rows_differing": max(r.rows_differing for _, r in results),
        "identical": identical,
        "toolchains": {name: r.as_dict() for name, r in results},
    }
    lines = [
        f"{name}: {r.kernel} vs {r.m1_kernel} (V={r.V}): {r.rows_differing}/{r.rows} rows differ, "
        f"max |diff| {r.max_abs_diff:g}"
        + (
            ""
            if r.sum_inputs is None
            else f"; simd_sum inputs differ for {r.sum_inputs_differing}/{r.sum_inputs} outputs"
        )
        for name, r in results
    ]
    human = f"{label}: {'identical' if identical else 'DIFFERENT'}\n" + "\n".join(lines)
    return payload, human, identical if kernel == "streamed" else True


def one_case(
    root: Path, header: Path | None, kernel: str, opts: dict[str, Any], say: Callable[[str], None]
) -> tuple[dict[str, Any], str, bool]:
    """Check one case; ok means the streamed kernel matched (or the wide one diverged)."""
    case = validate_case(opts)
    if kernel == "wide" and (case.hgs, case.rps) != (False, 4):
        raise UserError(f"{case.wide_kernel} has no global-scale or r_2 variant")
    text, types = _sources(root, case.header, header, opts, say)
    batched = case.streamed_kernel if kernel == "streamed" else case.wide_kernel
    results = []
    for name in _toolchains(opts["toolchain"]):
        say(f"building with {name}")
        kernels = case.header.upstream_kernels + case.header.streamed_kernels
        libs = suite.build_libraries(text, [case], build.TOOLCHAINS[name], kernels, types)
        lib = suite.library_for(libs, case)
        inputs = parity.make_inputs(case)
        say(f"running {case.label()} with {name}")
        record = kernel == "streamed"
        ref = parity.run_m1(lib, case, inputs, record=record)
        got = parity.run_batched(lib, case, inputs, batched, record=record)
        results.append((name, parity.compare(case, batched, ref, got)))
    return case_summary(case.label(), kernel, results)


def _modes(choice: str) -> tuple[str, ...]:
    """The modes a ``--mode`` choice runs."""
    if choice == "all":
        return tuple(FAMILIES)
    return FP_MODES if choice == "fp" else (choice,)


def _header_matrix(
    family: Header,
    text: emulate.Sources,
    types: tuple[str, ...],
    opts: dict[str, Any],
    modes: tuple[str, ...],
    say: Callable[[str], None],
) -> tuple[dict[str, Any], list[str], bool]:
    """``family``'s matrix for ``modes`` with each toolchain, judged by :func:`suite.summarize`."""
    cases = suite.full_matrix(modes) if opts["full"] else suite.default_matrix(modes)
    # The rebase gate's own matrix: its verdicts are kept for the gate (suite.keep_verdict).
    gates = not opts["full"] and tuple(modes) == modes_of(family)
    payload: dict[str, Any] = {"modes": list(modes), "cases": len(cases), "toolchains": {}}
    lines, ok = [], True
    label = "" if family is AFFINE else f"{family.name} ({', '.join(modes)}) "
    for name in _toolchains(opts["toolchain"]):
        where = name if family is AFFINE else f"{family.name} {name}"
        report = suite.run(
            text, cases, build.TOOLCHAINS[name], types=types, progress=_every_tenth(say, where)
        )
        if gates:
            suite.keep_verdict(family, text, types, report)
        summary = suite.summarize(report)
        ok = ok and bool(summary["ok"])
        payload["toolchains"][name] = summary
        lines.append(f"{label}{name}: {suite.summary_line(report, summary)}")
    payload["ok"] = ok
    return payload, lines, ok


def matrix(
    root: Path, header: Path | None, opts: dict[str, Any], say: Callable[[str], None]
) -> tuple[dict[str, Any], str, bool]:
    """The IR identity and the default (or full) matrix of each ``--mode``, judged.

    The affine payload keeps its shape at the top level (``cases``,
    ``toolchains``); the fp modes add an ``fp`` key (``modes``, ``cases``,
    ``toolchains``, ``ok``).
    """
    modes = _modes(opts.get("mode", "all"))
    payload: dict[str, Any] = {"ir": {}}
    lines, ok = [], True
    for family in dict.fromkeys(FAMILIES[m].header for m in modes):
        picked = tuple(m for m in modes if FAMILIES[m].header is family)
        # Read and rendered once per family: the IR check and the matrix share them.
        sources, types = _sources(root, family, header, opts, say)
        ir_part, ir_line, ir_ok = ir_identity(family, sources, types, say)
        payload["ir"][family.name] = ir_part
        part, part_lines, part_ok = _header_matrix(family, sources, types, opts, picked, say)
        if family is AFFINE:
            payload.update(cases=part["cases"], toolchains=part["toolchains"])
        else:
            payload[family.name] = part
        lines += [ir_line, *part_lines]
        ok = ok and part_ok and ir_ok
    payload["ok"] = ok
    return payload, "\n".join(lines) + ("\nOK" if ok else "\nFAILED"), ok
