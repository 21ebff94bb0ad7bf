"""The parity matrix of every family: which cases, built how, run how, judged how.

:func:`verify_header` and :func:`verify_fp_header` are the entry points other
steps use (``patchkit rebase`` gates on them): given a patched kernel header
they build the kernels with every gate toolchain, run the family's matrix, and
report whether every streamed row equals M = 1 and whether the ``qmv_wide``
control diverged where it must. Everything family-specific comes from
:mod:`families`; the matrices below are the only per-header data.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from patchkit.errors import UserError
from patchkit.util.staging import atomic_write_text
from patchkit.verify.emulate import build, extract, parity
from patchkit.verify.emulate.families import AFFINE, DTYPES, FAMILIES, FP, Header, modes_of
from patchkit.verify.emulate.parity import Case, Result

# (K, N) per M = 1 path, with the reason each shape is in the affine matrix.
AFFINE_SHAPES: dict[str, tuple[int, int]] = {
    # N % 8 == 0 and K % alignment == 0 for every bits: qmv_fast.
    "aligned": (1024, 64),
    # qmv's out_vec_size < 8 branch, which guards every row.
    "n_lt_8": (512, 5),
    # qmv's moved-back last tile (37 = 4 tiles of 8 + 5).
    "n_not_mult_8": (512, 37),
    # K % alignment != 0: qmv with its load_vector_safe / qdot_safe tail.
    "k_tail": (640, 32),
    # The K = 4096 class of real models, on qmv_fast.
    "k4096": (4096, 32),
}

# (K, N) per M = 1 path and branch, with the reason each shape is in the fp matrix.
# N is a few hundred where the path allows: fp rows carry no bias term to
# cancel against, so a float32 order difference shows in a float16 output only
# when it crosses a rounding boundary, and the control needs enough outputs
# per case to show it (measured at K = 1024, float16: fp_qmv_wide differed on
# 7% of cases at N = 64, 47% at N = 256, 80% at N = 512).
FP_SHAPES: dict[str, tuple[int, int]] = {
    # N % 8 == 0 and K % alignment == 0 for both bits: fp_qmv_fast.
    "aligned": (1024, 512),
    # fp_qmv's out_vec_size < 8 branch (guarded rows, qdot in the K tail).
    "n_lt_8": (512, 5),
    # The same branch with a K tail only some lanes reach.
    "n_lt_8_k_tail": (544, 6),
    # fp_qmv's moved-back last tile (261 = 32 tiles of 8 + 5), qdot_safe tail.
    "n_not_mult_8": (512, 261),
    # K % alignment != 0: fp_qmv with a K tail only some lanes reach.
    "k_tail": (544, 256),
    # The K = 4096 class of real models, on fp_qmv_fast.
    "k4096": (4096, 128),
}

# Long K on qmv's two row tilings (default matrices). At K = 512 a 2- to 5-bit
# qmv adds one main-loop block and its tail, two summands that commute, so a
# kernel adding its tail first would pass there. At K = 1152 every bits has at
# least two main-loop blocks before a tail (2-bit: 2 blocks of 512, then 128
# values only lanes 0..7 reach; 3/4/5-bit: 4 of 256, then lanes 0..15; 6/8-bit:
# 8 of 128, then a full block), and 1152 is a multiple of every group size.
LONG_K_SHAPES: dict[str, tuple[int, int]] = {
    "n_lt_8_long_k": (1152, 5),
    "n_not_mult_8_long_k": (1152, 37),
}
# (M, B, seed) of the float32 cases the default matrices add where detection
# power is: float32 outputs show every last-ulp float32 difference (the
# qmv_wide control differs on all of them). M = 3 (one full tile of V = 3) as a
# batch of 3; M = 6 (two full tiles of 3), alone and as a batch of 3 with a
# second seed.
FLOAT32_MBS = ((3, 3, 0), (6, 1, 0), (6, 3, 1))

# M = 2..16 covers every tile size V = 2..5 and every partial last tile.
ALL_M = tuple(range(2, 17))
# The affine default subset: every tile size V = 2..5 (M = 2..5), partial last
# tiles of V = 4 and 5 (M = 7, 9) and four tiles (M = 16).
DEFAULT_M = (2, 3, 4, 5, 7, 9, 16)
BATCHES = (1, 3)
# Multi-dimensional batches (the kernels' elem_to_loc / elem_to_loc_broadcast
# path): a (2, 3) batch with its own weights per batch, and with the weights
# shared along each batch dimension in turn (stride 0, as a broadcast array).
# As (batch, w_shared bitmask).
MULTI_BATCHES = (((2, 3), 0), ((2, 3), 0b01), ((2, 3), 0b10))
# Their M: a full tile (V = 3) and a partial last one (V = 4).
MULTI_M = (3, 7)


def multi_batch_cases(modes: tuple[str, ...]) -> list[Case]:
    """2-D batches on every M = 1 path of ``modes``, float32 and float16 (in the full matrix).

    Affine runs 4-bit at group size 64; the fp modes their plain variant (and
    nvfp4 its global scale), at N <= 64 for float32 as the fp matrix does.
    """
    cases: list[Case] = []
    for mode in modes:
        family = FAMILIES[mode]
        shapes = AFFINE_SHAPES if mode == "affine" else FP_SHAPES
        for shape, dtype, M, (batch, shared) in itertools.product(
            shapes.values(), ("float32", "float16"), MULTI_M, MULTI_BATCHES
        ):
            if mode == "affine":
                cases.append(
                    Case(
                        "affine",
                        *shape,
                        dtype,
                        M,
                        bits=4,
                        group_size=64,
                        batch=batch,
                        w_shared=shared,
                    )
                )
                continue
            K, N = _fp_shape(shape, dtype)
            for hgs in (False, True) if (True, 4) in family.variants else (False,):
                cases.append(Case(mode, K, N, dtype, M, hgs=hgs, batch=batch, w_shared=shared))
    return cases


def _affine_full(modes: tuple[str, ...]) -> list[Case]:
    """Every shape x bits x group size x dtype x M = 2..16 x B (about 8,100 cases), 2-D batches.

    Plus every default case the product does not hold (long K, seeds), so the
    full matrix contains the default one.
    """
    full = multi_batch_cases(modes) + [
        Case.affine(K, N, bits, gs, dtype, M, B)
        for (K, N), bits, gs, dtype, M, B in itertools.product(
            AFFINE_SHAPES.values(),  # shapes hitting each M = 1 path
            FAMILIES["affine"].bits,  # affine bits
            FAMILIES["affine"].group_sizes,  # group sizes
            DTYPES,  # activation/output dtypes
            ALL_M,  # batch rows
            BATCHES,  # batch count
        )
    ]
    return _with_default(full, _affine_default(modes))


def _with_default(full: list[Case], default: list[Case]) -> list[Case]:
    have = set(full)
    return full + [c for c in default if c not in have]


def _affine_default(modes: tuple[str, ...]) -> list[Case]:
    """A subset that runs in seconds (1,038 cases).

    Every shape, bits and dtype at group size 64 over M = 2..5, 7, 9, 16;
    group sizes 32/128 on 4-bit float16; and in float32, where detection power
    is, every shape (with the long-K ones) x bits x group size at
    :data:`FLOAT32_MBS` (M = 3 and 6, B = 3, a second seed).
    """
    cases = []
    for (K, N), bits, dtype, M in itertools.product(
        AFFINE_SHAPES.values(), FAMILIES["affine"].bits, DTYPES, DEFAULT_M
    ):
        B = 3 if M in (5, 7) else 1  # batched entry on a full and a partial tile
        cases.append(Case.affine(K, N, bits, 64, dtype, M, B))
    for (K, N), gs, dtype in itertools.product(AFFINE_SHAPES.values(), (32, 128), ("float16",)):
        cases += [Case.affine(K, N, 4, gs, dtype, M) for M in (2, 7, 16)]
    for (K, N), bits, gs, (M, B, seed) in itertools.product(
        [*AFFINE_SHAPES.values(), *LONG_K_SHAPES.values()],  # every M = 1 path, long K tails
        FAMILIES["affine"].bits,  # affine bits
        FAMILIES["affine"].group_sizes,  # group sizes
        FLOAT32_MBS,  # rows, batch, seed
    ):
        case = Case("affine", K, N, "float32", M, B, seed=seed, bits=bits, group_size=gs)
        cases.append(case)
    return cases


def small_shape(K: int, N: int) -> tuple[int, int]:
    """(K, N) at N <= 64 on the same M = 1 path and branch (37 keeps N % 8 != 0)."""
    return K, (N if N < 8 else (37 if N % 8 else 64))


def _fp_shape(shape: tuple[int, int], dtype: str) -> tuple[int, int]:
    # float16 runs the shapes at full N (what its control needs, see FP_SHAPES);
    # float32 (whose control differs at any N) and bfloat16 (quiet at any N this
    # emulator can afford) run them at N <= 64 on the same paths.
    return shape if dtype == "float16" else small_shape(*shape)


def _fp_full(modes: tuple[str, ...]) -> list[Case]:
    """Every mode x shape x dtype x M = 2..16 x B in {1, 3} x (global scale, tile) variant.

    Plus :func:`multi_batch_cases` and every default case the product does not
    hold (long K, seeds).
    """
    cases = multi_batch_cases(modes)
    for mode, shape, dtype, M, B in itertools.product(
        modes, FP_SHAPES.values(), DTYPES, ALL_M, BATCHES
    ):
        K, N = _fp_shape(shape, dtype)
        cases += [Case(mode, K, N, dtype, M, B, h, r) for h, r in FAMILIES[mode].variants_at(K, N)]
    return _with_default(cases, _fp_default(modes))


def _fp_default(modes: tuple[str, ...]) -> list[Case]:
    """A subset that runs in seconds: every mode, shape, dtype and tile size V = 2..5.

    On the two fp_qmv branches with a full tile (aligned, n_not_mult_8) M = 2 (as
    a batch of 3), 3, 4, 5 and 7 cover every tile size and a partial last tile;
    the other shapes take M = 2 (B = 3) and 7. The nvfp4 global-scale and r_2
    variants run on float16 and bfloat16 at M = 5. In float32 (N <= 64), every
    shape with the long-K ones, every variant, at :data:`FLOAT32_MBS`.
    """
    cases = []
    for mode, (name, shape), dtype in itertools.product(modes, FP_SHAPES.items(), DTYPES):
        K, N = _fp_shape(shape, dtype)
        Ms = (2, 3, 4, 5, 7) if name in ("aligned", "n_not_mult_8") else (2, 7)
        for M in Ms:
            cases.append(Case(mode, K, N, dtype, M, 3 if M == 2 else 1))
        if dtype != "float32":
            for hgs, rps in FAMILIES[mode].variants_at(K, N)[1:]:
                cases.append(Case(mode, K, N, dtype, 5, 1, hgs, rps))
    for mode, shape, (M, B, seed) in itertools.product(
        modes, [*FP_SHAPES.values(), *LONG_K_SHAPES.values()], FLOAT32_MBS
    ):
        K, N = small_shape(*shape)
        for hgs, rps in FAMILIES[mode].variants_at(K, N):
            cases.append(Case(mode, K, N, "float32", M, B, hgs, rps, seed))
    return cases


# header name -> (default matrix, full matrix), each over the header's modes asked for.
MATRICES: dict[str, tuple[Callable[[tuple[str, ...]], list[Case]], ...]] = {
    "affine": (_affine_default, _affine_full),
    "fp": (_fp_default, _fp_full),
}


def _by_header(modes: Iterable[str], which: int) -> list[Case]:
    modes = tuple(modes)
    unknown = set(modes) - set(FAMILIES)
    if unknown:
        raise UserError(f"unknown mode(s) {sorted(unknown)}; choose from {list(FAMILIES)}")
    cases: list[Case] = []
    for name, builders in MATRICES.items():
        picked = tuple(m for m in modes if FAMILIES[m].header.name == name)
        cases += builders[which](picked) if picked else []
    return cases


def default_matrix(modes: Iterable[str] = ("affine",)) -> list[Case]:
    """The default subset for ``modes`` (affine: 1,038 cases; the three fp modes: 290)."""
    return _by_header(modes, 0)


def full_matrix(modes: Iterable[str] = ("affine",)) -> list[Case]:
    """The whole matrix for ``modes`` (affine: 8,358 cases; fp: 2,860; 2-D batches included)."""
    return _by_header(modes, 1)


@dataclass
class Report:
    """Results of one run of one header's cases with one toolchain."""

    toolchain: str
    header: Header = AFFINE
    results: list[Result] = field(default_factory=list)

    def streamed(self) -> list[Result]:
        return [r for r in self.results if r.kernel != self.header.wide]

    def wide(self) -> list[Result]:
        return [r for r in self.results if r.kernel == self.header.wide]

    @property
    def streamed_identical(self) -> bool:
        return all(r.identical for r in self.streamed())

    def control_divergence(self, dtypes: Iterable[str] | None = None) -> float:
        """Fraction of control cases in ``dtypes`` (default: the gated ones) that differ."""
        wanted = set(self.header.control_groups[0] if dtypes is None else dtypes)
        picked = [r for r in self.wide() if r.case.dtype in wanted]
        return sum(not r.identical for r in picked) / len(picked) if picked else 0.0

    def failures(self) -> list[str]:
        return [
            f"{r.case.label()}: {r.rows_differing}/{r.rows} rows differ, simd_sum inputs "
            f"differ for {r.sum_inputs_differing}/{r.sum_inputs} outputs"
            + (f", {r.sum_calls_unconfirmed} calls unconfirmed" if r.sum_calls_unconfirmed else "")
            for r in self.streamed()
            if not r.identical
        ]


def _library_key(case: Case) -> tuple:
    if case.header.library_per_mode:
        return (case.mode,)
    return (case.dtype, case.bits)


def build_libraries(
    text: extract.Sources,
    cases: list[Case],
    toolchain: build.Toolchain,
    kernels: tuple[str, ...],
    types: tuple[str, ...] = (),
) -> dict[tuple, build.Library]:
    """The libraries ``cases`` need, keyed by :func:`_library_key`, built in parallel and cached.

    Affine builds one library per (dtype, bits), so the builds run in parallel
    and cache finely; the fp modes one per mode with every dtype (see
    :attr:`families.Header.library_per_mode`).
    """
    header = _one_header(cases)
    source = extract.extract(text, kernels, header, types)
    groups: dict[tuple, set[tuple[str, int, int]]] = {}
    for c in cases:
        dtypes = DTYPES if header.library_per_mode else (c.dtype,)
        groups.setdefault(_library_key(c), set()).update((d, c.group_size, c.bits) for d in dtypes)
    # Metal's address spaces checked by clang before any build, every header.
    build.check_address_spaces(source, sorted(set().union(*groups.values())))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        paths = pool.map(lambda g: build.build(source, sorted(g), toolchain), groups.values())
        return {key: build.Library(path) for key, path in zip(groups, paths, strict=True)}


def library_for(libs: dict[tuple, build.Library], case: Case) -> build.Library:
    """The library :func:`build_libraries` built for ``case``."""
    return libs[_library_key(case)]


def _one_header(cases: list[Case]) -> Header:
    headers = {c.header.name for c in cases}
    if len(headers) != 1:
        raise UserError(f"one run takes the cases of one kernel header, not {sorted(headers)}")
    return cases[0].header


def run_case(lib: build.Library, case: Case, controls: bool) -> list[Result]:
    """Streamed (and, where the plain variant runs, qmv_wide) against M = 1 for one case.

    The streamed kernel is compared twice over: its output rows, and the 32
    per-lane values each of its ``simd_sum`` calls is handed (recorded in both
    runs, :mod:`.sums`). ``qmv_wide`` reduces with ``simd_shuffle_down``
    (nothing to record), and has no global-scale or narrow-tile variant, so
    those cases carry no control.
    """
    inputs = parity.make_inputs(case)
    reference = parity.run_m1(lib, case, inputs, record=True)
    streamed = parity.run_batched(lib, case, inputs, case.streamed_kernel, record=True)
    results = [parity.compare(case, case.streamed_kernel, reference, streamed)]
    if controls and (case.hgs, case.rps) == (False, 4):
        wide = parity.run_batched(lib, case, inputs, case.wide_kernel)
        results.append(parity.compare(case, case.wide_kernel, reference, wide))
    return results


def run(
    text: extract.Sources,
    cases: list[Case],
    toolchain: build.Toolchain,
    *,
    types: tuple[str, ...] = (),
    controls: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Build ``text``'s kernels (upstream and patched; ``types``: type headers), run ``cases``.

    Builds and cases both run in parallel on all cores.
    """
    header = _one_header(cases)
    kernels = header.upstream_kernels + header.streamed_kernels
    libs = build_libraries(text, cases, toolchain, kernels, types)
    report = Report(toolchain.name, header)

    def one(case: Case) -> list[Result]:
        return run_case(library_for(libs, case), case, controls)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for i, results in enumerate(pool.map(one, cases), 1):
            report.results += results
            if progress:
                progress(i, len(cases))
    return report


_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}


def divergence_key(dtypes: tuple[str, ...]) -> str:
    """The JSON key of the control divergence over ``dtypes`` (``wide_divergence_f32_f16``)."""
    return "wide_divergence_" + "_".join(_SHORT[d] for d in dtypes)


def summarize(report: Report) -> dict[str, object]:
    """Counts for JSON and docs, and the verdict: every streamed row equal, control loud.

    ok needs every streamed case identical and the control differing on at
    least the header's ``min_control`` of the cases in its gated dtypes.
    """
    header, streamed = report.header, report.streamed()
    gate = report.control_divergence()
    return {
        "ok": report.streamed_identical and bool(report.wide()) and gate >= header.min_control,
        "streamed_cases": len(streamed),
        "streamed_differing": sum(not r.identical for r in streamed),
        "rows_checked": sum(r.rows for r in streamed),
        "rows_differing": sum(r.rows_differing for r in streamed),
        # Output elements whose simd_sum was handed the same 32 per-lane values
        # as at M = 1 (sums.py): equal inputs, equal result under any tree.
        "sum_inputs_checked": sum(r.sum_inputs or 0 for r in streamed),
        "sum_inputs_differing": sum(r.sum_inputs_differing or 0 for r in streamed),
        "sum_calls_unconfirmed": sum(r.sum_calls_unconfirmed or 0 for r in streamed),
        "control_cases": len(report.wide()),
        **{divergence_key(g): report.control_divergence(g) for g in header.control_groups},
        "failures": report.failures(),
    }


def summary_line(report: Report, summary: dict[str, object]) -> str:
    """One human line: streamed cases and differences, the control's divergence per dtype group."""
    groups = ", ".join(
        f"{summary[divergence_key(g)]:.0%} of {'/'.join(g)}" for g in report.header.control_groups
    )
    return (
        f"streamed {summary['streamed_cases']} cases, {summary['streamed_differing']} differing "
        f"(simd_sum inputs of {summary['sum_inputs_checked']} outputs, "
        f"{summary['sum_inputs_differing']} differing); "
        f"control {report.header.wide} differs on {groups} cases"
    )


def control_failure(report: Report) -> str | None:
    """Why the negative control does not count, or None when it is loud enough."""
    header = report.header
    gate = report.control_divergence()
    if report.wide() and gate >= header.min_control:
        return None
    return (
        f"negative control too quiet: {header.wide} differed on only {gate:.0%} of "
        f"{'/'.join(header.control_groups[0])} cases"
    )


@dataclass(frozen=True)
class Verdict:
    """What a rebase needs to know: did the patched header keep exactness."""

    ok: bool
    summary: str
    failures: list[str]


CACHED = " (cached)"


@functools.cache
def _emulator_digest() -> str:
    """The emulator's own sources (this package: Python, shim, runner), the dispatch rules
    that pick each case's kernel and tile (``patchkit/verify/dispatch.py``) and numpy, which
    draws the inputs: a verdict from another emulator is never reused."""
    here = Path(__file__).parent
    digest = hashlib.sha256(f"numpy {np.__version__}".encode())
    for path in [*sorted(here.iterdir()), here.parent / "dispatch.py"]:
        if path.suffix in (".py", ".h", ".cpp"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _compiler_identity(name: str) -> tuple[str, ...]:
    """A toolchain's name, compiler path, ``--version`` text and flags: asked once per
    process (a gate looks each toolchain up, then keeps what it ran)."""
    toolchain = build.TOOLCHAINS[name]
    compiler = build.require_compiler(toolchain)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=False, timeout=30).stdout  # fmt: skip
    return (name, compiler, version, *toolchain.flags)


def _verdict_path(
    header: Header, sources: extract.Sources, types: tuple[str, ...], cases: Iterable[Case],
    name: str,
) -> Path:  # fmt: skip
    """Where one toolchain's verdict on exactly these inputs is kept: the texts, the cases,
    the compiler (path, version, flags) and the emulator's sources."""
    matrix = hashlib.sha256("\n".join(sorted(map(repr, set(cases)))).encode()).hexdigest()
    parts = [header.name, matrix, sources.upstream, sources.patched, *types,
             _emulator_digest(), *_compiler_identity(name)]  # fmt: skip
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return build.cache_dir() / "verdicts" / f"{header.name}-{name}-{key[:32]}.json"


def toolchain_verdict(report: Report) -> Verdict:
    """One toolchain's run judged as the gate judges it: every streamed row equal, the
    control loud enough."""
    name, header = report.toolchain, report.header
    failures = [f"[{name}] {f}" for f in report.failures()]
    quiet = control_failure(report)
    failures += [f"[{name}] {quiet}"] if quiet else []
    line = f"{name} ({header.name}): {summary_line(report, summarize(report))}"
    return Verdict(ok=not failures, summary=line, failures=failures)


def keep_verdict(
    header: Header, sources: extract.Sources, types: tuple[str, ...], report: Report
) -> Verdict:
    """Keep ``report``'s verdict where :func:`verify` looks for it, under the cases the
    report ran, and return it: ``patchkit emulate``'s default matrix is the gate's, so the
    set-up's run answers a later rebase's gate."""
    verdict = toolchain_verdict(report)
    kept = _verdict_path(header, sources, types, [r.case for r in report.results],
                         report.toolchain)  # fmt: skip
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(kept, json.dumps(dataclasses.asdict(verdict)))
    except OSError as exc:  # the verdict stands; only the next run's shortcut is lost
        print(f"warning: could not keep the verdict in {kept.parent}: {exc}", file=sys.stderr)
    return verdict


def verify(
    header: Header,
    sources: extract.Sources,
    types: tuple[str, ...] = (),
    *,
    quick: bool = True,
    toolchains: Iterable[str] = build.GATE,
    say: Callable[[str], None] | None = None,
) -> Verdict:
    """Run ``header``'s parity suite on a tree's text, upstream and patched, with each toolchain.

    A toolchain's verdict is a function of its inputs alone (fixed cases, fixed seeds), so
    it is kept under their digest: a rebase whose kernel text did not change, on a machine
    that ran the set-up's ``patchkit emulate --toolchain all``, answers at once. ``say``
    hears each toolchain's start with the time left, from the toolchains run so far
    (compiling dominates the first run on a machine)."""
    names = list(toolchains)
    modes = modes_of(header)
    cases = default_matrix(modes) if quick else full_matrix(modes)
    verdicts: dict[str, Verdict] = {}
    for name in names:
        try:
            data = json.loads(_verdict_path(header, sources, types, cases, name).read_text())
            verdicts[name] = Verdict(data["ok"], data["summary"] + CACHED, list(data["failures"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass  # not run with these inputs yet (or a torn file): run it below
    todo = [n for n in names if n not in verdicts]
    started = time.monotonic()
    for done, name in enumerate(todo):
        if say is not None:
            left = ""
            if done:
                each = (time.monotonic() - started) / done
                left = f", about {each * (len(todo) - done):.0f} s left"
            say(f"parity: {header.name} suite, {name} ({done + 1} of {len(todo)} to run){left}")
        report = run(sources, cases, build.TOOLCHAINS[name], types=types)
        verdicts[name] = keep_verdict(header, sources, types, report)
    ordered = [verdicts[n] for n in names]
    return Verdict(
        ok=all(v.ok for v in ordered),
        summary="; ".join(v.summary for v in ordered),
        failures=[f for v in ordered for f in v.failures],
    )


def verify_header(
    sources: extract.Sources,
    *,
    quick: bool = True,
    toolchains: Iterable[str] = build.GATE,
    say: Callable[[str], None] | None = None,
) -> Verdict:
    """The affine suite on a tree's ``quantized.h``, upstream and patched (``rebase``'s gate)."""
    return verify(AFFINE, sources, quick=quick, toolchains=toolchains, say=say)


def verify_fp_header(
    sources: extract.Sources,
    types: tuple[str, ...],
    *,
    quick: bool = True,
    toolchains: Iterable[str] = build.GATE,
    say: Callable[[str], None] | None = None,
) -> Verdict:
    """The fp suite on a tree's ``fp_quantized.h``; ``types`` are the tree's fp4.h and fp8.h."""
    return verify(FP, sources, types, quick=quick, toolchains=toolchains, say=say)
