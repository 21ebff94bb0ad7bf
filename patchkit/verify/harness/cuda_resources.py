"""What the compiler made of the tensor-core qmv kernel, read from its library alone.

Registers, spill stack and shared memory per instance come from ``cuobjdump -res-usage``
of a library ``bench/cuda_qmv.py build`` compiled with MLX's own nvcc flags; how many warps
an SM can then hold follows from the architecture's fixed budgets. Both are compile-time
facts, readable on any machine with nvcc and cuobjdump: no GPU. What they leave open
(achieved occupancy, bandwidth, stall reasons) needs Nsight Compute on a GPU host
(``bench/cuda_qmv.py profile``).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from patchkit.carry import mlx_build
from patchkit.verify.harness import cuda

# cuobjdump -res-usage: a "Function NAME:" line, then its resources on the next line.
RESOURCES = re.compile(
    r"^\s*Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", re.M
)
# qmv_mma_kernel<tiles, k_warps, stages, blocks_per_sm, group_size, has_bias, T, Q, S>; a
# kernel experiment (bench/variants) may take integer arguments of its own after tiles.
MMA_KERNEL = re.compile(
    r"qmv_mma_kernelILi(\d+)E((?:Li\d+E){4,})Lb([01])EN7cutlass(\d+)(\w+?_t)E(.*)$"
)
# sm_90's budgets per SM (CUDA programming guide, compute capability 9.0): registers,
# resident warps and blocks, shared memory, and the shared memory the system reserves per
# block; registers are allocated per warp in units of 256.
SM90 = {"registers": 65536, "warps": 64, "blocks": 32, "shared": 228 * 1024,
        "shared_per_block_reserved": 1024, "register_unit": 256}  # fmt: skip


@dataclass(frozen=True)
class Instance:
    """One compiled qmv_mma_kernel: its template arguments and what it uses."""

    mode: str  # affine 4-bit, affine 8-bit, nvfp4, mxfp4, mxfp8
    dtype: str  # bfloat16, float16
    group_size: int
    tiles: int  # tiles of 16 weight rows per warp
    k_warps: int
    stages: int
    blocks_per_sm: int  # the launch bound's minimum, which caps the registers
    registers: int
    stack_bytes: int  # per thread: spilled registers live here
    shared_bytes: int
    extra: tuple[int, ...] = ()  # a variant's own template arguments, after tiles

    def warps_per_sm(self, budget: dict[str, int] = SM90) -> int:
        """Warps an SM holds at most: whole blocks of ``k_warps``, within every budget."""
        unit = budget["register_unit"]
        per_warp = -(-self.registers * 32 // unit) * unit
        by_registers = budget["registers"] // per_warp // self.k_warps
        per_block = self.shared_bytes + budget["shared_per_block_reserved"]
        by_shared = budget["shared"] // per_block
        by_warps = budget["warps"] // self.k_warps
        return min(by_registers, by_shared, by_warps, budget["blocks"]) * self.k_warps


def mode_of(q_and_s: str) -> str:
    """The quantization mode from the mangled Q and S template arguments."""
    if "integer_subbyteILi4" in q_and_s:
        return "affine 4-bit"
    if "float_e2m1_t" in q_and_s:
        return "mxfp4" if "ue8m0" in q_and_s else "nvfp4"
    if "float_e4m3_t" in q_and_s and "ue8m0" in q_and_s:
        return "mxfp8"
    if q_and_s.startswith("h"):  # uint8_t
        return "affine 8-bit"
    raise ValueError(f"unknown weight type in qmv_mma_kernel<..., {q_and_s}>")


def template_args(name: str) -> dict[str, Any] | None:
    """A ``qmv_mma_kernel`` instance's template arguments, from its mangled name, as
    :class:`Instance` names them; None for another kernel (upstream's qmv, gather_qmv)."""
    if not (m := MMA_KERNEL.search(name)):
        return None
    tiles, ints, _bias, _len, dtype, rest = m.groups()
    *extra, k_warps, stages, blocks, group = (int(v) for v in re.findall(r"Li(\d+)E", ints))
    return {
        "mode": mode_of(rest),
        "dtype": {"bfloat16_t": "bfloat16", "half_t": "float16"}[dtype],
        "group_size": int(group),
        "tiles": int(tiles),
        "k_warps": int(k_warps),
        "stages": int(stages),
        "blocks_per_sm": int(blocks),
        **({"extra": tuple(extra)} if extra else {}),
    }


def parse(res_usage: str) -> list[Instance]:
    """The qmv_mma_kernel instances of one library's ``cuobjdump -res-usage`` output, in
    its order; other kernels (upstream's qmv, gather_qmv) are left out."""
    found = []
    for name, reg, stack, shared, _local in RESOURCES.findall(res_usage):
        if (args := template_args(name)) is None:
            continue
        found.append(
            Instance(
                **args,
                registers=int(reg),
                stack_bytes=int(stack),
                shared_bytes=int(shared),
            )
        )
    return found


def res_usage(lib: Path, cuobjdump: str = "cuobjdump") -> str:
    """``cuobjdump -res-usage`` of ``lib``."""
    try:
        done = subprocess.run([cuobjdump, "-res-usage", str(lib)], capture_output=True,
                              text=True, check=False)  # fmt: skip
    except FileNotFoundError:
        raise SystemExit(
            f"{cuobjdump} not found: CUDA's toolkit has it, or pip install nvidia-cuda-cuobjdump"
        ) from None
    if done.returncode:
        raise SystemExit(f"cuobjdump -res-usage {lib} failed: {done.stderr.strip()[-400:]}")
    return done.stdout


def record(libraries: dict[str, Iterable[Instance]], meta: dict[str, Any]) -> dict[str, Any]:
    """The page's JSON: ``meta`` (what was compiled, how) and one entry per instance of each
    library (the shipped kernel, variants of its launch constants), with the warps per SM
    its resources allow beside the ones its launch bound asks for."""
    rows = [{"library": name, **{k: v for k, v in asdict(i).items() if k != "extra" or v},
             "warps_per_sm": i.warps_per_sm(),
             "warps_asked": i.blocks_per_sm * i.k_warps}
            for name, instances in libraries.items() for i in instances]  # fmt: skip
    return {**meta, "libraries": list(libraries), "instances": rows}


def tiles_cell(tiles: int, extra: Iterable[int] | None) -> str:
    """A table's tiles cell, with a variant's own template arguments beside it."""
    own = ", ".join(map(str, extra or ()))
    return f"{tiles} [own: {own}]" if own else str(tiles)


def _spills(rows: list[dict[str, Any]]) -> str:
    """One library's spilling instances, in words."""
    spilling = [r for r in rows if r["stack_bytes"]]
    stacks = sorted(r["stack_bytes"] for r in spilling)
    kinds = ", ".join(sorted({f"{r['mode']} {r['dtype']}" for r in spilling}))
    where = ""
    if spilling:
        span = f"{stacks[0]}" if stacks[0] == stacks[-1] else f"{stacks[0]} to {stacks[-1]}"
        where = f" ({kinds}; {span} bytes a thread)"
    return f"{len(spilling)} of {len(rows)} instances spill registers to the stack{where}"


def page(data: dict[str, Any]) -> str:
    """Markdown: registers, spills and the warps an SM can hold, per instance."""
    rows = data["instances"]
    lines = [
        "# CUDA: what the compiler made of the tensor-core qmv kernel (static)",
        "",
        f"**What this is.** `cuobjdump -res-usage` of the patched `qmv.cu` compiled alone "
        f"with MLX's nvcc flags for `sm_{data['arch']}` ({data['nvcc']}); the warps an SM "
        "holds follow from compute capability 9.0's budgets (65536 registers, 64 warps, 32 "
        "blocks, 228 KiB of shared memory, 1 KiB of it reserved per block). Compile-time "
        "facts, no GPU: achieved occupancy, bandwidth and stall reasons need Nsight Compute "
        "on a GPU host (`bench/cuda_qmv.py profile`). For kernel work; the PR quotes none "
        "of it.",
        "",
        mlx_build.valid_while("cuda", data["build_inputs_sha256"]) + ".",
        *(
            f"- `{name}`: " + _spills([r for r in rows if r["library"] == name])
            for name in data["libraries"]
        ),
        f"- Libraries, by their launch constants ({', '.join(cuda.LAUNCH_CONSTANTS)}): "
        + "; ".join(f"`{n}` {','.join(map(str, data['constants'][n]))}" for n in data["libraries"])
        + ".",
        "- Commands: `python3 bench/cuda_qmv.py build --out LIBS"
        + "".join(
            f" --variant {n}={','.join(map(str, data['constants'][n]))}"
            for n in data["libraries"]
            if n != "shipped"
        )
        + "`, then `"
        + data["command"]
        + "`.",
        "",
        "| library | mode | dtype | group | tiles | warps over K | stages | registers | stack B "
        "| shared B | warps/SM asked | warps/SM possible |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['library']} | {r['mode']} | {r['dtype']} | {r['group_size']} | "
            f"{tiles_cell(r['tiles'], r.get('extra'))} | "
            f"{r['k_warps']} | {r['stages']} | {r['registers']} | {r['stack_bytes']} | "
            f"{r['shared_bytes']} | {r['warps_asked']} | {r['warps_per_sm']} |"
        )
    return "\n".join(lines) + "\n"
