"""Compile extracted kernel source against the Metal shim into a shared library.

Four builds, because nobody documents how much Metal's compiler fuses a
multiply and an add under MLX's fast-math-off settings: g++ with
``-ffp-contract=off`` (no fusion anywhere), clang with ``-ffp-contract=on
-mfma`` (fusion within an expression), and g++ and clang at ``-O2`` with
``-ffp-contract=fast -mfma`` (fusion across statements, once functions are
inlined). Identity must hold under all of them (:data:`GATE`).

Libraries are cached by the hash of their full source and command line in the
user cache directory, so a rerun compiles nothing.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from patchkit.errors import UserError
from patchkit.util import cache
from patchkit.util import proc as tools
from patchkit.verify.emulate.extract import Extracted

HERE = Path(__file__).resolve().parent
DTYPES = {"float32": (0, "float"), "float16": (1, "float16_t"), "bfloat16": (2, "bfloat16_t")}


@dataclass(frozen=True)
class Toolchain:
    """A compiler and the floating-point contraction mode it is asked for."""

    name: str
    compiler: str
    flags: tuple[str, ...]


_X86 = platform.machine() in ("x86_64", "AMD64")


def _fma_flags() -> tuple[str, ...]:
    # -mfma is an x86 flag; aarch64 always has fused multiply-add.
    return ("-mfma",) if _X86 else ()


# g++ forms a fused multiply-add only when the multiply and the add meet in
# one function body and one basic block, so whether qdot's `scale * accum`
# fuses with the caller's `result +=` depends on whether qdot was inlined:
# g++'s size heuristics inline it into one kernel and not another (measured:
# not into fp_qmv_fast_impl for nvfp4, yes into the streamed kernel). Metal
# inlines every function (METAL_FUNC is always_inline, and its GPU code has no
# calls here), so the cross-statement build lifts g++'s inlining limits.
_INLINE_ALL = (
    "--param=max-inline-insns-single=100000",
    "--param=max-inline-insns-auto=100000",
    "--param=large-function-growth=1000000",
    "--param=large-function-insns=1000000",
    "--param=inline-unit-growth=1000000",
    "--param=large-stack-frame-growth=100000",
)

# Optimisation levels are chosen for suite wall time (build + run on 2 cores):
# g++ -O1 builds in ~2 s a library and runs ~3x faster than -O0; clang -O1
# builds 6x slower than -O0. Neither level changes contraction: clang -O0
# still emits the fused multiply-adds -ffp-contract=on asks for (a test checks).
# A GPU thread computes in scalar registers; the host's auto-vectorizers would pack
# independent per-vector sums of one thread into SIMD registers, where the backend
# pairs multiplies with adds for fusion differently than in scalar code (measured:
# clang's SLP vectorizer changed the fused pairs of 3-bit float32 qmv_fast at
# vecs_per_tg > 1 on x86). The contraction builds model the GPU's scalar code.
_SCALAR_CLANG = ("-fno-slp-vectorize", "-fno-vectorize")
_SCALAR_GCC = ("-fno-tree-vectorize",)
TOOLCHAINS = {
    "gcc": Toolchain("gcc", "g++", ("-O1", "-ffp-contract=off")),
    "clang": Toolchain("clang", "clang++", ("-O0", "-ffp-contract=on", *_fma_flags())),
    "gcc-fast": Toolchain(
        "gcc-fast",
        "g++",
        ("-O2", "-ffp-contract=fast", *_fma_flags(), *_INLINE_ALL, *_SCALAR_GCC),
    ),
    "clang-fast": Toolchain(
        "clang-fast", "clang++", ("-O2", "-ffp-contract=fast", *_fma_flags(), *_SCALAR_CLANG)
    ),
}
# The builds every gate (`patchkit emulate`, rebase's suites) runs and needs to agree.
GATE = ("gcc", "clang", "gcc-fast", "clang-fast")
# AddressSanitizer and UndefinedBehaviorSanitizer, aborting on the first report
# (sanitize.py); not a gate build. Its libraries load only into a process that
# has the ASan runtime first (sanitizer_env).
SANITIZE = Toolchain(
    "gcc-asan",
    "g++",
    (
        "-O1",
        "-ffp-contract=off",
        "-g",
        "-fno-omit-frame-pointer",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=all",
    ),
)
TOOLCHAINS[SANITIZE.name] = SANITIZE


def sanitizer_env() -> dict[str, str]:
    """The environment for a Python process that loads SANITIZE libraries.

    The ASan runtime is preloaded (it must come before every other library);
    leak checking is off because the interpreter itself does not free
    everything at exit.
    """
    compiler = require_compiler(SANITIZE)
    proc = subprocess.run(
        [compiler, "-print-file-name=libasan.so"], capture_output=True, text=True, check=True
    )
    runtime = proc.stdout.strip()
    if not os.path.isabs(runtime):
        raise UserError(f"{compiler} has no ASan runtime (Debian: apt-get install g++)")
    return {
        **os.environ,
        "LD_PRELOAD": runtime,
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0:exitcode=23",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1:exitcode=23",
    }


COMMON_FLAGS = (
    "-std=c++20",
    "-shared",
    "-fPIC",
    # qdot reads 4-bit packs through a uint16_t pointer into a byte array.
    "-fno-strict-aliasing",
    "-Wno-attributes",
    "-w",
    # half <-> float through the F16C instructions (metal_shim.h): straight-line
    # conversions, so basic-block-local contraction sees the kernel's structure.
    *(("-mf16c",) if _X86 else ()),
)


def cache_dir() -> Path:
    """Where built libraries live: the cache's ``emulate`` folder."""
    return cache.folder("emulate")


def require_compiler(toolchain: Toolchain) -> str:
    """Path of the toolchain's compiler, or a UserError saying how to install it."""
    path = shutil.which(toolchain.compiler)
    if path is None:
        pkg = "clang" if toolchain.compiler.startswith("clang") else "g++"
        raise UserError(
            f"{toolchain.compiler} not found: install it (Debian: apt-get install {pkg}) "
            f"or choose another toolchain with --toolchain"
        )
    return path


def translation_unit(extracted: Extracted, combos: list[tuple[str, int, int]]) -> str:
    """The full C++ source: shim, kernel source, family, combos and the runner."""
    header = extracted.header
    has = "\n".join(
        f"#define PATCHKIT_HAS_{kernel.removeprefix(header.kernel_prefix)} 1"
        for kernel in extracted.kernels
    )
    combo_lines = " ".join(
        f"PATCHKIT_COMBO({DTYPES[d][1]}, {DTYPES[d][0]}, {g}, {b})" for d, g, b in combos
    )
    return "\n".join(
        [
            '#include "metal_shim.h"',
            extracted.source,
            f"#define PATCHKIT_FAMILY_{header.runner_family} 1",
            has,
            f"#define PATCHKIT_COMBOS {combo_lines}",
            (HERE / "runner.cpp").read_text(),
        ]
    )


def build(
    extracted: Extracted,
    combos: list[tuple[str, int, int]],
    toolchain: Toolchain,
) -> Path:
    """A shared library running ``extracted``'s kernels for ``combos``; cached."""
    compiler = require_compiler(toolchain)
    source = translation_unit(extracted, combos)
    cmd_tail = [*COMMON_FLAGS, *toolchain.flags, f"-I{HERE}"]
    shim = (HERE / "metal_shim.h").read_text()
    key = hashlib.sha256("\0".join([source, shim, compiler, *cmd_tail]).encode()).hexdigest()
    out = cache_dir() / f"{toolchain.name}-{key[:24]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "kernels.cpp"
        src.write_text(source)
        lib = Path(tmp) / "lib.so"
        cmd = [compiler, *cmd_tail, str(src), "-o", str(lib)]
        tools.run(cmd)
        os.replace(lib, out)  # atomic: a concurrent build never sees half a library
    return out


def check_address_spaces(extracted: Extracted, combos: list[tuple[str, int, int]]) -> None:
    """Compile the kernels with Metal's address spaces as clang's; a mismatch is a UserError.

    ``clang++ -fsyntax-only -DPATCHKIT_ADDRESS_SPACES``: ``device``, ``constant`` and
    ``threadgroup`` become clang address spaces 1, 2 and 3 (``metal_shim.h``), so a
    ``thread`` pointer handed to a ``device`` parameter fails as it does in Metal's
    compiler. The error names the line of the kernel source. A passing check is
    cached like a library.
    """
    compiler = require_compiler(TOOLCHAINS["clang"])
    source = translation_unit(extracted, combos)
    cmd_tail = [
        "-std=c++20",
        "-fsyntax-only",
        "-DPATCHKIT_ADDRESS_SPACES",
        # half (clang's __fp16 here) passed and returned by value, as fp4.h and
        # fp8.h do; ARM targets have this on, x86 needs it asked of the front end.
        "-Xclang",
        "-fallow-half-arguments-and-returns",
        "-w",
        f"-I{HERE}",
    ]
    shim = (HERE / "metal_shim.h").read_text()
    key = hashlib.sha256("\0".join([source, shim, compiler, *cmd_tail]).encode()).hexdigest()
    marker = cache_dir() / f"address-spaces-{key[:24]}.ok"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=marker.parent) as tmp:
        src = Path(tmp) / "kernels.cpp"
        src.write_text(source)
        proc = subprocess.run([compiler, *cmd_tail, str(src)], capture_output=True, text=True)
    if proc.returncode != 0:
        errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
        first = errors[0].split("kernels.cpp:", 1)[-1] if errors else proc.stderr.strip()
        lines = source.splitlines()
        number = int(first.split(":", 1)[0]) if first[:1].isdigit() else 0
        text = lines[number - 1].strip() if 0 < number <= len(lines) else ""
        raise UserError(
            f"address-space check failed ({len(errors)} errors): line {first}\n  {text}"
        )
    marker.touch()


class Library:
    """A loaded kernel library of one family; ``run`` executes one kernel launch."""

    def __init__(self, path: Path):
        self._lib = ctypes.CDLL(str(path))
        self._run = self._lib.pk_run
        self._run.restype = ctypes.c_int
        self._run.argtypes = (
            [ctypes.c_int] * 11
            + [ctypes.c_void_p] * 6
            + [ctypes.c_int] * 2
            + [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            + [ctypes.c_char_p, ctypes.c_int]
        )

    def decode(self, kind: int, byte: int) -> float:
        """The compiled fp4_e2m1 (0), fp8_e4m3 (1) or fp8_e8m0 (2) decode of ``byte`` (fp only)."""
        fn = self._lib.pk_fp_decode
        fn.restype = ctypes.c_float
        fn.argtypes = [ctypes.c_int, ctypes.c_int]
        return float(fn(kind, byte))

    def run(
        self,
        dtype: str,
        gs: int,
        bits: int,
        kind: int,
        V: int,
        dims: tuple[int, int, int, int],
        buffers: tuple,
        hgs: bool = False,
        rps: int = 4,
        batch: tuple[int, ...] = (),
        w_shared: int = 0,
        record: np.ndarray | None = None,
    ) -> int:
        """Run kernel ``kind`` with ``dims = (B, M, N, K)`` on numpy ``buffers``.

        ``buffers`` are (w, scales, biases or global scale, x, y); ``hgs`` and
        ``rps`` pick nvfp4's global-scale and narrow-tile variants. ``batch``
        (product B) is a multi-dimensional batch shape, ``w_shared`` the bitmask
        of its dimensions along which the weights are shared (stride 0); by
        default the batch is one dimension of B. ``record`` (an array of
        :data:`sums.RECORD`) receives every ``simd_sum`` call of the launch;
        returns how many were recorded.
        """
        err = ctypes.create_string_buffer(512)
        count = ctypes.c_int(0)
        where = None if record is None else record.ctypes.data
        ptrs = [buf.ctypes.data for buf in buffers]
        shape = (ctypes.c_int * max(len(batch), 1))(*batch)
        rc = self._run(
            DTYPES[dtype][0],
            gs,
            bits,
            kind,
            V,
            int(hgs),
            rps,
            *dims,
            *ptrs,
            ctypes.cast(shape, ctypes.c_void_p),
            len(batch),
            w_shared,
            where,
            0 if record is None else len(record),
            ctypes.byref(count),
            err,
            len(err),
        )
        if rc == 1:
            raise UserError(f"emulated kernel failed: {err.value.decode()}")
        if rc == 2:
            raise UserError(
                f"kernel {kind} for {dtype} gs={gs} bits={bits} hgs={hgs} rps={rps} not built"
            )
        return count.value
