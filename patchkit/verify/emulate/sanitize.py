"""The streamed kernels under AddressSanitizer and UndefinedBehaviorSanitizer.

Output parity cannot see a kernel that reads past a buffer when the bytes it
reads do not reach a stored row (a partial last tile reading the rows after M,
a K tail reading past the row). This runs the M = 1 kernels, the streamed
kernels and ``qmv_wide`` over partial tiles, N < 8, K tails and B > 1 (one and
two batch dimensions) in a ``g++ -fsanitize=address,undefined
-fno-sanitize-recover=all`` build (:data:`build.SANITIZE`), in a child Python
process with the ASan runtime preloaded; every buffer is its own exact-size
allocation (:func:`parity.run_m1` copies its slices). A report aborts the
child with exit status 23.

``python -m patchkit.verify.emulate.sanitize affine|fp [--text FILE]`` runs
one header's cases (``--text``: a kernel header to use instead of the patched
pinned one) and prints one summary line.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
from pathlib import Path

from patchkit.verify.emulate import build, suite
from patchkit.verify.emulate.families import AFFINE, FAMILIES, FP, FP_MODES
from patchkit.verify.emulate.parity import Case

# Exit status of a child whose sanitizer reported (build.sanitizer_env).
REPORTED = 23


def cases(header: str) -> list[Case]:
    """Partial tiles (M 3, 7), N < 8, N % 8 != 0, K tails, B 3 and (2, 3) batches, per header.

    fp: every mode on every shape at N <= 64, float32, M 7, B 3, with nvfp4's
    global-scale and r_2 variants wherever MLX has them; and a (2, 3) batch
    with weights shared along its first dimension on both M = 1 paths of each
    mode (nvfp4 with its global scale).
    """
    if header == "affine":
        out = [
            Case.affine(K, N, bits, 64, dtype, M, 3)
            for (K, N), bits, dtype, M in itertools.product(
                suite.AFFINE_SHAPES.values(), (3, 4, 8), ("float32", "float16"), (3, 7)
            )
        ]
        out += [
            Case("affine", K, N, "float32", 7, bits=4, group_size=64, batch=(2, 3), w_shared=1)
            for K, N in suite.AFFINE_SHAPES.values()
        ]
        return out
    out = []
    for mode, (K, N) in itertools.product(FP_MODES, suite.FP_SHAPES.values()):
        K, N = suite.small_shape(K, N)
        variants = FAMILIES[mode].variants_at(K, N)
        out += [Case(mode, K, N, "float32", 7, 3, h, r) for h, r in variants]
    for mode, name in itertools.product(FP_MODES, ("aligned", "k_tail")):
        K, N = suite.small_shape(*suite.FP_SHAPES[name])
        hgs = (True, 4) in FAMILIES[mode].variants
        out.append(Case(mode, K, N, "float32", 7, hgs=hgs, batch=(2, 3), w_shared=1))
    return out


def run_child(header: str, text_file: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``header``'s sanitizer cases in a child with the ASan runtime; its result."""
    cmd = [sys.executable, "-m", "patchkit.verify.emulate.sanitize", header]
    if text_file is not None:
        cmd += ["--text", str(text_file)]
    return subprocess.run(cmd, capture_output=True, text=True, env=build.sanitizer_env())


def main(argv: list[str] | None = None) -> int:
    from patchkit.verify import emulate

    # Compilers this process starts must not run with the ASan runtime preloaded.
    os.environ.pop("LD_PRELOAD", None)
    args = argparse.ArgumentParser()
    args.add_argument("header", choices=("affine", "fp"))
    args.add_argument("--text", type=Path)
    a = args.parse_args(argv)
    root = Path(__file__).resolve().parents[3]
    family = AFFINE if a.header == "affine" else FP
    upstream, types = emulate.pinned_sources(root, family)
    text = emulate.sources(upstream, family)
    if a.text is not None:  # a patched text to check instead (the tests' mutations)
        text = emulate.Sources(upstream, a.text.read_text())
    todo = cases(a.header)
    report = suite.run(text, todo, build.SANITIZE, types=types)
    summary = suite.summarize(report)
    print(
        f"{a.header} {build.SANITIZE.name}: {suite.summary_line(report, summary)}; "
        f"rows {summary['rows_checked']}, differing {summary['rows_differing']}"
    )
    return 0 if report.streamed_identical else 1


if __name__ == "__main__":
    sys.exit(main())
