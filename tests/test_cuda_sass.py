"""bench/cuda_qmv.py sass: instructions per step of the tensor-core qmv's main loop, read
from nvdisasm text (here written by hand in its layout; no CUDA tools needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support_scripts import load_script

from patchkit.verify.harness import cuda_sass

# qmv_mma_kernel<1 tile, 4 warps over K, 2 stages, 4 blocks, group 64, bias, bfloat16, u8>
NAME = "_ZN3mlx4core2cu14qmv_mma_kernelILi1ELi4ELi2ELi4ELi64ELb1EN7cutlass10bfloat16_tEhS4_EEvPKT5_"


def _function(name: str, body: list[str]) -> str:
    """One function as nvdisasm -c prints it: labels, then `/*addr*/ instruction ;`."""
    lines = [f"//---- .text.{name} ----", f"\t.section\t.text.{name},\"ax\",@progbits",
             f".text.{name}:"]  # fmt: skip
    for i, ins in enumerate(body):
        lines.append(ins if ins.endswith(":") else f"        /*{16 * i:04x}*/  {ins} ;")
    return "\n".join(lines) + "\n"


# A short loop without MMAs (the prologue's), then the main loop: two steps of one HMMA,
# one predicated HMMA and two other instructions each, closed by a branch back.
BODY = [
    "S2R R0, SR_TID.X",
    ".L_x_1:",
    "IADD3 R1, R1, 0x1, RZ",
    "@P1 BRA `(.L_x_1)",
    ".L_x_2:",
    "LDS R4, [R2]",
    "HMMA.16816.F32.BF16 R8, R4, R6, R8",
    "@P0 HMMA.16816.F32.BF16 R12, R4, R7, R12",
    "PRMT R5, R4, 0x5410, R5",
    "@!P2 LDS R4, [R2+0x10]",
    "HMMA.16816.F32.BF16 R8, R4, R6, R8",
    "@P0 HMMA.16816.F32.BF16 R12, R4, R7, R12",
    "@!P3 BRA `(.L_x_2)",
    "EXIT",
]


def test_the_main_loop_is_the_smallest_one_holding_every_mma() -> None:
    sass = _function(NAME, BODY) + _function("_Z5otherv", ["S2R R0, SR_TID.X", "EXIT"])
    (c,) = cuda_sass.count(sass)
    assert (c.mode, c.dtype, c.group_size, c.tiles, c.k_warps, c.stages) == (
        "affine 8-bit", "bfloat16", 64, 1, 4, 2)  # fmt: skip
    # 8 instructions over 2 steps (the prologue's loop and EXIT are outside)
    assert c.per_step == 4 and c.mma_per_step == 2
    assert c.mix == {"HMMA": 2, "LDS": 1, "PRMT": 0.5, "BRA": 0.5}
    # the control: with the last MMA after the branch, no loop holds every MMA
    moved = [*BODY[:-3], BODY[-2], BODY[-3], BODY[-1]]
    assert cuda_sass.count(_function(NAME, moved)) == []


def test_opcodes_drop_predicates_and_modifiers() -> None:
    assert cuda_sass.opcode("@!P0 LDG.E.128 R4, desc[UR6][R2.64]") == "LDG"
    assert cuda_sass.opcode("@!UPT UIADD3 URZ, URZ, URZ, URZ") == "UIADD3"
    assert cuda_sass.opcode("@PT HMMA.16816.F32.BF16 R8, R4, R6, RZ") == "HMMA"


def test_the_table_lists_each_library_and_instance() -> None:
    (c,) = cuda_sass.count(_function(NAME, BODY))
    text = cuda_sass.table({"shipped": [c], "v": [c]}, top=2)
    assert "| shipped | affine 8-bit | bfloat16 | 64 | 1 | 4 | 4 | 2 | HMMA 2, LDS 1 |" in text
    assert "| v | affine 8-bit |" in text


def test_sass_without_a_build_is_a_one_line_error(tmp_path: Path) -> None:
    bench = load_script("bench/cuda_qmv.py")
    with pytest.raises(SystemExit, match=r"patched\.so: run `bench/cuda_qmv\.py build` first"):
        bench.sass(tmp_path, None, None, ("cuobjdump", "nvdisasm"))
    missing = r"nvdisasm-missing not found: .*pip install nvidia-cuda-nvdisasm"
    with pytest.raises(SystemExit, match=missing):
        cuda_sass._tool(["nvdisasm-missing"], str(tmp_path), "nvdisasm")
