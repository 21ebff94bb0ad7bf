"""The parity matrix: which cases, built how, run how, judged how.

``verify_header`` is the entry point other steps use (``patchkit rebase``
gates on it): given a patched ``quantized.h`` it builds the kernels with both
toolchains, runs the matrix, and reports whether every streamed row equals
M = 1 and whether the ``qmv_wide`` control diverged where it must.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from patchkit.verify.emulate import build, extract, parity
from patchkit.verify.emulate.parity import BITS, DTYPES, GROUP_SIZES, Case, Result

# (K, N) per M = 1 path, with the reason each shape is in the matrix.
SHAPES: dict[str, tuple[int, int]] = {
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
# M = 2..16 covers every tile size V = 2..5 and every partial last tile.
ALL_M = tuple(range(2, 17))
# The default subset: every tile size V = 2..5 (M = 2..5), partial last tiles
# of V = 4 and 5 (M = 7, 9) and four tiles (M = 16).
DEFAULT_M = (2, 3, 4, 5, 7, 9, 16)
BATCHES = (1, 3)

STREAMED = "streamed"
ALL_KERNELS = extract.UPSTREAM_KERNELS + extract.STREAMED_KERNELS
WIDE = "qmv_wide"


def full_matrix() -> list[Case]:
    """The whole matrix of the kernel issue (about 8,100 cases)."""
    return [
        Case(K, N, bits, gs, dtype, M, B)
        for (K, N), bits, gs, dtype, M, B in itertools.product(
            SHAPES.values(),  # shapes hitting each M = 1 path
            BITS,  # affine bits
            GROUP_SIZES,  # group sizes
            DTYPES,  # activation/output dtypes
            ALL_M,  # batch rows
            BATCHES,  # batch count
        )
    ]


def default_matrix() -> list[Case]:
    """A subset that runs in seconds: every shape, bits and dtype; group sizes on 4-bit."""
    cases = []
    for (K, N), bits, dtype, M in itertools.product(SHAPES.values(), BITS, DTYPES, DEFAULT_M):
        B = 3 if M in (5, 7) else 1  # batched entry on a full and a partial tile
        cases.append(Case(K, N, bits, 64, dtype, M, B))
    for (K, N), gs, dtype in itertools.product(SHAPES.values(), (32, 128), ("float16",)):
        cases += [Case(K, N, 4, gs, dtype, M) for M in (2, 7, 16)]
    return cases


@dataclass
class Report:
    """Results of one run of the matrix with one toolchain."""

    toolchain: str
    results: list[Result] = field(default_factory=list)

    def streamed(self) -> list[Result]:
        return [r for r in self.results if r.kernel != WIDE]

    def wide(self) -> list[Result]:
        return [r for r in self.results if r.kernel == WIDE]

    @property
    def streamed_identical(self) -> bool:
        return all(r.identical for r in self.streamed())

    def control_divergence(self, dtypes: Iterable[str] = ("float32", "float16")) -> float:
        """Fraction of control cases in ``dtypes`` where qmv_wide differs from M = 1."""
        picked = [r for r in self.wide() if r.case.dtype in set(dtypes)]
        return sum(not r.identical for r in picked) / len(picked) if picked else 0.0

    def failures(self) -> list[str]:
        return [
            f"{r.case.label()}: {r.rows_differing}/{r.rows} rows differ"
            for r in self.streamed()
            if not r.identical
        ]


def _combos(cases: Iterable[Case]) -> list[tuple[str, int, int]]:
    return sorted({(c.dtype, c.group_size, c.bits) for c in cases})


def build_libraries(
    header: str, cases: list[Case], toolchain: build.Toolchain, kernels: tuple[str, ...]
) -> dict[tuple[str, int], build.Library]:
    """One library per (dtype, bits), so the builds run in parallel and cache finely."""
    source = extract.extract(header, kernels)
    groups: dict[tuple[str, int], list[tuple[str, int, int]]] = {}
    for dtype, gs, bits in _combos(cases):
        groups.setdefault((dtype, bits), []).append((dtype, gs, bits))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        paths = dict(
            zip(
                groups,
                pool.map(lambda g: build.build(source, g, toolchain), groups.values()),
                strict=True,
            )
        )
    return {key: build.Library(path) for key, path in paths.items()}


def run_case(lib: build.Library, case: Case, controls: bool) -> list[Result]:
    """Streamed (and optionally qmv_wide) against M = 1 for one case."""
    inputs = parity.make_inputs(case)
    reference = parity.run_m1(lib, case, inputs)
    kernels = [case.streamed_kernel] + ([WIDE] if controls else [])
    return [
        parity.compare(case, k, reference, parity.run_batched(lib, case, inputs, k))
        for k in kernels
    ]


def run(
    header: str,
    cases: list[Case],
    toolchain: build.Toolchain,
    *,
    controls: bool = True,
    streamed: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Build the kernels from ``header`` and run ``cases``; both in parallel on all cores."""
    kernels = extract.UPSTREAM_KERNELS + (extract.STREAMED_KERNELS if streamed else ())
    libs = build_libraries(header, cases, toolchain, kernels)
    report = Report(toolchain.name)

    def one(case: Case) -> list[Result]:
        lib = libs[(case.dtype, case.bits)]
        if streamed:
            return run_case(lib, case, controls)
        inputs = parity.make_inputs(case)
        ref = parity.run_m1(lib, case, inputs)
        return [parity.compare(case, WIDE, ref, parity.run_batched(lib, case, inputs, WIDE))]

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for i, results in enumerate(pool.map(one, cases), 1):
            report.results += results
            if progress:
                progress(i, len(cases))
    return report


@dataclass(frozen=True)
class Verdict:
    """What a rebase needs to know: did the patched header keep exactness."""

    ok: bool
    summary: str
    failures: list[str]


# A harness that cannot see qmv_wide diverge proves nothing; on the default
# matrix it diverges on nearly every float32/float16 case (see docs/kernel.md).
MIN_CONTROL_DIVERGENCE = 0.5


def verify_header(
    patched_header: str, *, quick: bool = True, toolchains: Iterable[str] = ("gcc", "clang")
) -> Verdict:
    """Run the parity suite on a patched ``quantized.h`` text with each toolchain."""
    cases = default_matrix() if quick else full_matrix()
    failures: list[str] = []
    lines = []
    for name in toolchains:
        report = run(patched_header, cases, build.TOOLCHAINS[name])
        divergence = report.control_divergence()
        failures += [f"[{name}] {f}" for f in report.failures()]
        if divergence < MIN_CONTROL_DIVERGENCE:
            failures.append(
                f"[{name}] negative control too quiet: qmv_wide differed on only "
                f"{divergence:.0%} of float32/float16 cases"
            )
        lines.append(
            f"{name}: {len(report.streamed())} streamed cases, "
            f"{sum(not r.identical for r in report.streamed())} differing; "
            f"qmv_wide differs on {divergence:.0%} of float32/float16 cases"
        )
    return Verdict(ok=not failures, summary="; ".join(lines), failures=failures)
