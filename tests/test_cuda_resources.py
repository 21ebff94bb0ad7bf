"""patchkit.verify.harness.cuda_resources: the tensor-core kernel's registers, spills and
the warps an SM can hold, read from cuobjdump's output; and its page in docs/results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from patchkit.carry import mlx_build, pin
from patchkit.verify.harness import cuda_resources as res

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "results" / "cuda-kernel-resources.json"

# cuobjdump -res-usage's form: a Function line, its resources on the next. Mangled names of
# qmv_mma_kernel<1, k_warps, stages, blocks, group, bias, T, Q, S> and one other kernel.
AFFINE4 = (
    "_ZN3mlx4core2cu14qmv_mma_kernelILi1ELi8ELi4ELi2ELi64ELb1EN7cutlass10bfloat16_tENS3_"
    "15integer_subbyteILi4ELb0EEES4_EEvPKT5_PKT6_PKT7_S9_PKfPS7_iiib"
)
AFFINE8 = (
    "_ZN3mlx4core2cu14qmv_mma_kernelILi1ELi4ELi4ELi4ELi128ELb1EN7cutlass6half_tEhS4_EEvPKT5_"
    "PKT6_PKT7_S7_PKfPS5_iiib"
)
NVFP4 = (
    "_ZN3mlx4core2cu14qmv_mma_kernelILi1ELi8ELi4ELi2ELi16ELb0EN7cutlass10bfloat16_tENS3_"
    "12float_e2m1_tENS3_12float_e4m3_tEEEvPKT5_PKT6_PKT7_S9_PKfPS7_iiib"
)
MXFP8 = (
    "_ZN3mlx4core2cu14qmv_mma_kernelILi1ELi8ELi4ELi2ELi32ELb0EN7cutlass6half_tENS3_"
    "12float_e4m3_tENS3_13float_ue8m0_tEEEvPKT5_PKT6_PKT7_S9_PKfPS7_iiib"
)
OTHER = "_ZN3mlx4core2cu10qmv_kernelILi8ELi8ELi128ELb1ELb0EN7cutlass10bfloat16_tEhS4_EEvPKT4_"


def _usage(*functions: tuple[str, int, int, int]) -> str:
    lines = ["", "Fatbin elf code:", "arch = sm_90a", "Resource usage:", " Common:",
             "  GLOBAL:81 CONSTANT[4]:440"]  # fmt: skip
    for name, reg, stack, shared in functions:
        lines += [f" Function {name}:",
                  f"  REG:{reg} STACK:{stack} SHARED:{shared} LOCAL:0 CONSTANT[0]:589 "
                  "TEXTURE:0 SURFACE:0 SAMPLER:0"]  # fmt: skip
    return "\n".join(lines) + "\n"


def test_instances_are_read_with_their_template_arguments() -> None:
    text = _usage((AFFINE4, 128, 16, 41984), (OTHER, 33, 0, 0), (AFFINE8, 125, 0, 21504),
                  (NVFP4, 116, 0, 41984), (MXFP8, 80, 0, 41984))  # fmt: skip
    got = res.parse(text)
    seen = [(i.mode, i.dtype, i.group_size, i.k_warps, i.registers, i.stack_bytes) for i in got]
    assert seen == [
        ("affine 4-bit", "bfloat16", 64, 8, 128, 16),
        ("affine 8-bit", "float16", 128, 4, 125, 0),
        ("nvfp4", "bfloat16", 16, 8, 116, 0),
        ("mxfp8", "float16", 32, 8, 80, 0),
    ]  # upstream's qmv_kernel is not the patch's kernel: left out
    assert got[0].blocks_per_sm == 2 and got[1].blocks_per_sm == 4


def test_a_variants_own_template_arguments_are_read_apart() -> None:
    """A kernel experiment's integer arguments after tiles (row-pointers.diff's second MMA
    switch) are its own: the launch constants are still the last four (control: the
    shipped kernel has none)."""
    variant = AFFINE4.replace("ILi1ELi8E", "ILi1ELi2ELi8E")
    got = res.parse(_usage((variant, 120, 0, 21504), (AFFINE4, 128, 16, 41984)))
    assert [(i.tiles, i.extra, i.k_warps, i.stages, i.group_size) for i in got] == [
        (1, (2,), 8, 4, 64),
        (1, (), 8, 4, 64),
    ]
    assert res.tiles_cell(1, (2,)) == "1 [own: 2]" and res.tiles_cell(1, ()) == "1"
    rows = res.record({"b": got[:1], "shipped": got[1:]}, {})["instances"]
    assert rows[0]["extra"] == (2,) and "extra" not in rows[1]  # the shipped rows unchanged


def test_warps_per_sm_follow_the_tightest_budget() -> None:
    base = res.Instance("affine 4-bit", "bfloat16", 64, 1, 8, 4, 2, 128, 16, 41984)
    # 128 registers: 4096 a warp, 16 warps of the 65536, two blocks of 8
    assert base.warps_per_sm() == 16
    # control: 80 registers (2560 a warp) let 25 warps in, so 3 whole blocks of 8
    assert res.Instance(**{**base.__dict__, "registers": 80}).warps_per_sm() == 24
    # registers round up to units of 256 a warp: 81 take 2816, room for 23 warps, 2 blocks
    assert res.Instance(**{**base.__dict__, "registers": 81}).warps_per_sm() == 16
    # shared memory binds when a block holds more: 5 blocks of 44 KiB fit, 6 do not
    few = res.Instance(**{**base.__dict__, "registers": 32, "k_warps": 4})
    assert few.warps_per_sm() == 5 * 4


def test_the_page_names_spills_and_what_it_holds_for() -> None:
    got = res.parse(_usage((AFFINE4, 128, 16, 41984), (AFFINE8, 125, 0, 21504)))
    constants = {"shipped": [1, 4, 16, 8, 8192, 4], "st3": [1, 3, 16, 8, 8192, 4]}
    meta = {"arch": "90a", "nvcc": "Build cuda_13.0", "build_inputs_sha256": "ab" * 32,
            "command": "python3 bench/cuda_qmv.py resources --libs LIBS --out x",
            "constants": constants}  # fmt: skip
    data = res.record({"shipped": got, "st3": got[1:]}, meta)
    assert data["instances"][0]["warps_asked"] == 16 == data["instances"][0]["warps_per_sm"]
    text = res.page(data)
    assert (
        "- `shipped`: 1 of 2 instances spill registers to the stack (affine 4-bit "
        "bfloat16; 16 bytes a thread)" in text
    )
    assert "build --out LIBS --variant st3=1,3,16,8,8192,4`, then `python3" in text
    assert (
        "| shipped | affine 8-bit | float16 | 128 | 1 | 4 | 4 | 125 | 0 | 21504 | 16 | 16 |" in text
    )
    assert "build inputs sha256 `abababababababab`" in text
    # control: a library with nothing spilling says so without a range
    assert "- `st3`: 0 of 1 instances spill registers to the stack\n" in text


def test_an_unknown_weight_type_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown weight type"):
        res.parse(_usage((AFFINE8.replace("EhS4_", "EtS4_"), 1, 0, 0)))


def test_the_committed_page_is_of_what_the_cuda_build_compiles_now() -> None:
    """docs/results/cuda-kernel-resources.json describes the kernel as the patch renders it:
    a CUDA edit leaves it stale (decision 0008); and it says what it read."""
    if not PAGE.exists():
        pytest.skip("no static resources page committed")
    data = json.loads(PAGE.read_text())
    short = pin.load(ROOT / pin.PIN_FILE).short
    assert data["build_inputs_sha256"] == mlx_build.build_inputs_id(ROOT, short, "cuda"), (
        "cuda-kernel-resources.json is of other CUDA inputs: rebuild with bench/cuda_qmv.py "
        "build and rerun bench/cuda_qmv.py resources"
    )
    assert data["instances"] and all(r["registers"] > 0 for r in data["instances"])
    assert PAGE.with_suffix(".md").read_text() == res.page(data)
