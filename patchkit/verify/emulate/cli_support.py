"""What ``patchkit emulate`` computes, shaped for printing; cli.py only prints it.

Kept out of cli.py because it is not terminal code: it validates a case,
runs the suite and builds the JSON payload and the human summary.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from patchkit.errors import UserError
from patchkit.verify import emulate
from patchkit.verify.emulate import build, extract, fp, parity, suite


def _toolchains(choice: str) -> list[str]:
    return ["gcc", "clang"] if choice == "both" else [choice]


def validate_case(opts: dict[str, Any]) -> parity.Case:
    """A Case from CLI options, or a one-line UserError saying what is wrong."""
    missing = [f"-{k}" for k in ("K", "N") if opts.get(k) is None]
    if missing:
        raise UserError(f"--kernel checks one case: give {' and '.join(missing)}")
    bits, gs = opts["bits"], opts["group_size"]
    if bits not in parity.BITS:
        raise UserError(f"unsupported --bits {bits}; choose from {list(parity.BITS)}")
    if gs not in parity.GROUP_SIZES:
        raise UserError(f"unsupported --group-size {gs}; choose from {list(parity.GROUP_SIZES)}")
    K, N, M, B = opts["K"], opts["N"], opts["M"], opts["B"]
    if K <= 0 or N <= 0 or M < 1 or B < 1:
        raise UserError("-K, -N, -M and -B must be positive")
    if K % gs:
        raise UserError(f"-K {K} is not a multiple of --group-size {gs}")
    if K in (64, 128):
        raise UserError(f"-K {K} runs qmv_quad in MLX, which this kernel does not replace")
    return parity.Case(K, N, bits, gs, opts["dtype"], M, B)


def _every_tenth(say: Callable[[str], None], what: str) -> Callable[[int, int], None]:
    """A progress callback that speaks at each tenth of the cases, not at every one.

    Piped output (CI logs) gets one line per step; a terminal spinner loses nothing.
    """

    def report(i: int, n: int) -> None:
        if i == n or i % max(1, n // 10) == 0:
            say(f"{what}: case {i}/{n}")

    return report


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
        for name, r in results
    ]
    human = f"{label}: {'identical' if identical else 'DIFFERENT'}\n" + "\n".join(lines)
    return payload, human, identical if kernel == "streamed" else True


def one_case(
    root: Path, header: Path | None, kernel: str, opts: dict[str, Any], say: Callable[[str], None]
) -> tuple[dict[str, Any], str, bool]:
    """Check one case; ok means the streamed kernel matched (or the wide one diverged)."""
    case = validate_case(opts)
    say("reading the pinned header")
    text = emulate.patched_header(emulate.pinned_header(root, header))
    batched = case.streamed_kernel if kernel == "streamed" else suite.WIDE
    results = []
    for name in _toolchains(opts["toolchain"]):
        say(f"building with {name}")
        libs = suite.build_libraries(text, [case], build.TOOLCHAINS[name], suite.ALL_KERNELS)
        lib = libs[(case.dtype, case.bits)]
        inputs = parity.make_inputs(case)
        say(f"running {case.label()} with {name}")
        ref = parity.run_m1(lib, case, inputs)
        results.append(
            (
                name,
                parity.compare(case, batched, ref, parity.run_batched(lib, case, inputs, batched)),
            )
        )
    return case_summary(case.label(), kernel, results)


def _fp_modes(choice: str) -> tuple[str, ...]:
    """The fp modes a ``--mode`` choice runs (none for ``affine``)."""
    if choice in ("all", "fp"):
        return tuple(fp.MODES)
    return (choice,) if choice in fp.MODES else ()


def fp_one_case(
    root: Path, kernel: str, opts: dict[str, Any], say: Callable[[str], None]
) -> tuple[dict[str, Any], str, bool]:
    """Check one fp case; ok means the streamed kernel matched (or the wide one diverged)."""
    mode = opts["mode"]
    if mode not in fp.MODES:
        raise UserError("--kernel checks one mode: choose --mode affine, mxfp4, nvfp4 or mxfp8")
    missing = [f"-{k}" for k in ("K", "N") if opts.get(k) is None]
    if missing:
        raise UserError(f"--kernel checks one case: give {' and '.join(missing)}")
    K, N, M, B = opts["K"], opts["N"], opts["M"], opts["B"]
    if K <= 0 or N <= 0 or M < 1 or B < 1:
        raise UserError("-K, -N, -M and -B must be positive")
    gs = fp.MODES[mode][0]
    if K % gs:
        raise UserError(f"-K {K} is not a multiple of {mode}'s group size {gs}")
    if K in (64, 128) and not opts["global_scale"]:
        raise UserError(f"-K {K} runs qmv_quad in MLX, which this kernel does not replace")
    case = fp.FpCase(
        mode, K, N, opts["dtype"], M, B, opts["global_scale"], 2 if opts["narrow"] else 4
    )
    if kernel == "wide" and (case.hgs or case.rps != 4):
        raise UserError("fp_qmv_wide has no global-scale or r_2 variant")
    say("reading the pinned fp header")
    upstream, types = fp.pinned_fp_headers(root, opts.get("fp_header"))
    text = fp.patched_fp_header(upstream)
    batched = case.streamed_kernel if kernel == "streamed" else fp.WIDE
    results = []
    for name in _toolchains(opts["toolchain"]):
        say(f"building with {name}")
        libs = fp.build_libraries(
            text,
            types,
            [case],
            build.TOOLCHAINS[name],
            extract.FP_UPSTREAM_KERNELS + extract.FP_STREAMED_KERNELS,
        )
        lib = libs[case.mode]
        inputs = fp.make_inputs(case)
        say(f"running {case.label()} with {name}")
        ref = fp.run_m1(lib, case, inputs)
        got = fp.run_batched(lib, case, inputs, batched)
        results.append((name, parity.compare(case, batched, ref, got)))  # type: ignore[arg-type]
    return case_summary(case.label(), kernel, results)


def _fp_matrix(
    root: Path, opts: dict[str, Any], modes: tuple[str, ...], say: Callable[[str], None]
) -> tuple[dict[str, Any], list[str], bool]:
    """The fp matrix for ``modes`` with each toolchain, judged by :func:`fp.verdict`."""
    say("reading the pinned fp header")
    upstream, types = fp.pinned_fp_headers(root, opts.get("fp_header"))
    text = fp.patched_fp_header(upstream)
    cases = fp.full_matrix(modes) if opts["full"] else fp.default_matrix(modes)
    payload: dict[str, Any] = {"modes": list(modes), "cases": len(cases), "toolchains": {}}
    lines, ok = [], True
    for name in _toolchains(opts["toolchain"]):
        report = fp.run(
            text,
            types,
            cases,
            build.TOOLCHAINS[name],
            progress=_every_tenth(say, f"fp {name}"),
        )
        summary = fp.summarize(report)
        ok = ok and bool(summary["ok"])
        payload["toolchains"][name] = summary
        lines.append(
            f"fp ({', '.join(modes)}) {name}: streamed {summary['streamed_cases']} cases, "
            f"{summary['streamed_differing']} differing; control fp_qmv_wide differs on "
            f"{summary['wide_divergence_f32']:.0%} of float32, "
            f"{summary['wide_divergence_f16']:.0%} of float16, "
            f"{summary['wide_divergence_bf16']:.0%} of bfloat16 cases"
        )
    payload["ok"] = ok
    return payload, lines, ok


def matrix(
    root: Path, header: Path | None, opts: dict[str, Any], say: Callable[[str], None]
) -> tuple[dict[str, Any], str, bool]:
    """Run the default (or full) matrix of each ``--mode`` with each toolchain and judge it.

    The affine payload keeps its shape at the top level; fp modes add an ``fp`` key.
    """
    mode = opts.get("mode", "affine")
    payload: dict[str, Any] = {}
    lines, ok = [], True
    if mode in ("all", "affine"):
        say("reading the pinned header")
        text = emulate.patched_header(emulate.pinned_header(root, header))
        cases = suite.full_matrix() if opts["full"] else suite.default_matrix()
        payload = {"cases": len(cases), "toolchains": {}}
        for name in _toolchains(opts["toolchain"]):
            report = suite.run(
                text,
                cases,
                build.TOOLCHAINS[name],
                progress=_every_tenth(say, name),
            )
            divergence = report.control_divergence()
            toolchain_ok = report.streamed_identical and divergence >= suite.MIN_CONTROL_DIVERGENCE
            ok = ok and toolchain_ok
            payload["toolchains"][name] = {
                "ok": toolchain_ok,
                "streamed_cases": len(report.streamed()),
                "streamed_differing": sum(not r.identical for r in report.streamed()),
                "wide_divergence_f32_f16": divergence,
                "wide_divergence_bf16": report.control_divergence(("bfloat16",)),
                "failures": report.failures(),
            }
            lines.append(
                f"{name}: streamed {len(report.streamed())} cases, "
                f"{payload['toolchains'][name]['streamed_differing']} differing; "
                f"control qmv_wide differs on {divergence:.0%} of float32/float16 cases"
            )
    modes = _fp_modes(mode)
    if modes:
        fp_payload, fp_lines, fp_ok = _fp_matrix(root, opts, modes, say)
        payload["fp"] = fp_payload
        lines += fp_lines
        ok = ok and fp_ok
    payload["ok"] = ok
    return payload, "\n".join(lines) + ("\nOK" if ok else "\nFAILED"), ok
