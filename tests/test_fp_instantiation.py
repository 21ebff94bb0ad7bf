"""The fp streamed kernels the host asks for are the ones fp_quantized.metal instantiates.

quantized.cpp builds a kernel name (``kname``) and, for the JIT build, a template
definition from ``get_quantized_kernel_wrapped``'s arguments; fp_quantized.metal
instantiates names and template arguments through its macros. A mismatch only
shows on a Mac, at run time, as a missing kernel. This test expands the
rendered .metal macros with the C preprocessor and checks every name the
rendered host code can ask for against them, with its template arguments.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from patchkit.carry import cxx, export

ROOT = Path(__file__).resolve().parent.parent
OVERLAY = ROOT / "patches" / "9a795735" / "overlay" / "mlx" / "backend" / "metal"
METAL = "kernels/fp_quantized.metal"
HOST = "quantized.cpp"
HEADER = "kernels/fp_quantized.h"

MODES = {"mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
TYPES = ("float", "float16_t", "bfloat16_t")  # get_type_string's Metal names


def _text(rel: str) -> str:
    return export.strip_header(f"mlx/backend/metal/{rel}", (OVERLAY / rel).read_text())


@pytest.fixture(scope="module")
def instantiated() -> dict[str, tuple[str, tuple[str, ...]]]:
    """{kernel name: (function, template arguments)} for every streamed instantiation."""
    cpp = shutil.which("cpp")
    if cpp is None:
        pytest.skip("needs the C preprocessor (cpp)")
    body = "\n".join(line for line in _text(METAL).splitlines() if not line.startswith("#include"))
    prelude = (
        "#define instantiate_kernel(name, func, ...) PK_KERNEL name | func | __VA_ARGS__ PK_END\n"
    )
    out = subprocess.run(
        [cpp, "-P"], input=prelude + body, capture_output=True, text=True, check=True
    ).stdout
    found = {}
    for m in re.finditer(r"PK_KERNEL (.*?) \| (\w+) \| (.*?) PK_END", out):
        name = "".join(re.findall(r'"([^"]*)"', m.group(1)))
        args = tuple(a.strip() for a in m.group(3).split(","))
        if "streamed" in m.group(2):
            found[name] = (m.group(2), args)
    return found


def test_host_name_and_jit_arguments_follow_the_kernel_signature() -> None:
    host = _text(HOST)
    fn = cxx.find_function(host, "fp_qmv_streamed").text(host)
    pieces = [
        '"_qmv_fast_streamed_" : "_qmv_streamed_"',
        '"_gs_"',
        '"_b_"',
        'use_narrow_qmv ? "_r_2" : ""',
        '"_nv_"',
        'batched ? "_batch_1" : "_batch_0"',
        'global_scale ? "_hgs" : ""',
    ]
    positions = [fn.index(p) for p in pieces]
    assert positions == sorted(positions)
    fast_call = re.sub(r"\s+", " ", fn[fn.index('"qmv_fast_streamed",') :])
    assert fast_call.startswith(
        '"qmv_fast_streamed", mode, type_string, group_size, bits, vecs_per_tg, batched, '
        "global_scale.has_value(), results_per_simdgroup);"
    )
    # The kernel's template parameters are in that order.
    header = _text(HEADER)
    kernel = cxx.find_function(header, "fp_qmv_fast_streamed").text(header)
    params = re.findall(r"(?:typename|int|bool)\s+(\w+)", kernel[: kernel.index("[[kernel]]")])
    assert params == [
        "T",
        "group_size",
        "bits",
        "vecs_per_tg",
        "batched",
        "has_global_scale",
        "results_per_simdgroup",
    ]


def test_every_name_the_host_builds_is_instantiated_with_its_arguments(
    instantiated: dict[str, tuple[str, tuple[str, ...]]],
) -> None:
    expected = {}
    for (mode, (gs, bits)), t, fast, V, b, hgs in itertools.product(
        MODES.items(), TYPES, (True, False), (2, 3, 4, 5), (0, 1), (False, True)
    ):
        for narrow in (False, True) if (fast and mode == "nvfp4") else (False,):
            kernel = "qmv_fast_streamed" if fast else "qmv_streamed"
            name = (
                f"{mode}_{kernel}_{t}_gs_{gs}_b_{bits}{'_r_2' if narrow else ''}"
                f"_nv_{V}_batch_{b}{'_hgs' if hgs else ''}"
            )
            args = (t, str(gs), str(bits), str(V), str(b), str(int(hgs)))
            if fast:
                args += ("2" if narrow else "4",)
            expected[name] = (f"fp_{kernel}", args)
    assert len(instantiated) == 336  # 112 per type: docs/kernel.md
    assert set(expected) == set(instantiated)
    for name, (func, args) in expected.items():
        got_func, got_args = instantiated[name]
        defaults = ("0", "4") if func == "fp_qmv_fast_streamed" else ("0",)
        filled = got_args + defaults[len(got_args) - 5 :]
        normed = tuple({"true": "1", "false": "0"}.get(a, a) for a in filled)
        assert (got_func, normed) == (func, args), name
