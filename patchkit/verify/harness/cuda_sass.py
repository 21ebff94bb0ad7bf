"""Instructions per step of the tensor-core qmv's main loop, read from its SASS.

A static proxy for kernel work on a machine without a GPU: the loop that holds every MMA
of a ``qmv_mma_kernel`` instance runs ``stages`` steps of K per pass, so its length over
``stages`` is what one step issues (instructions under a branch counted as if taken), and
its opcodes say where they go (dequantization, MMAs, address arithmetic). Read from
``nvdisasm`` of the library ``bench/cuda_qmv.py build`` compiled; how long the
instructions wait (latency, stalls) is for Nsight Compute on a GPU host.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from patchkit.verify.harness.cuda_resources import template_args, tiles_cell

# nvdisasm -c: "        /*0a30*/                   HMMA.16816.F32.BF16 R40, R40, R76, RZ ;"
INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.+?)\s*;")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH_TO = re.compile(r"\bBRA(?:\.\w+)*\s+`?\(?(\.L_x_\d+)")
FUNCTION = re.compile(r"^\s*\.text\.(\S+):\s*$", re.M)
PREDICATE = re.compile(r"^@!?U?P[T\d]+\s+")


@dataclass(frozen=True)
class LoopCount:
    """One instance's main loop, per step of K."""

    mode: str
    dtype: str
    group_size: int
    tiles: int
    k_warps: int
    stages: int
    blocks_per_sm: int
    per_step: float  # instructions
    mma_per_step: float
    mix: dict[str, float] = field(default_factory=dict)  # opcode: instructions per step
    extra: tuple[int, ...] = ()  # a variant's own template arguments, after tiles


def opcode(instruction: str) -> str:
    """``@!P0 LDG.E.128 R4, [R2]`` -> ``LDG``."""
    return PREDICATE.sub("", instruction).split()[0].split(".")[0]


def functions(sass: str) -> dict[str, str]:
    """Each function's text in ``nvdisasm`` output, by mangled name."""
    heads = list(FUNCTION.finditer(sass))
    ends = [h.start() for h in heads[1:]] + [len(sass)]
    return {h.group(1): sass[h.end() : end] for h, end in zip(heads, ends, strict=True)}


def main_loop(text: str) -> list[str] | None:
    """The instructions of the smallest loop (a branch back to an earlier label) that
    holds every MMA of a function; None where no loop does."""
    instructions: list[str] = []
    labels: dict[str, int] = {}
    for line in text.splitlines():
        if m := LABEL.match(line):
            labels[m.group(1)] = len(instructions)
        elif m := INSTRUCTION.search(line):
            instructions.append(m.group(1))
    mmas = [i for i, ins in enumerate(instructions) if opcode(ins) == "HMMA"]
    if not mmas:
        return None
    loops = [
        (labels[m.group(1)], i)
        for i, ins in enumerate(instructions)
        if (m := BRANCH_TO.search(ins)) and labels.get(m.group(1), i + 1) <= i
    ]
    holding = [(a, b) for a, b in loops if a <= mmas[0] and mmas[-1] <= b]
    if not holding:
        return None
    a, b = min(holding, key=lambda ab: ab[1] - ab[0])
    return instructions[a : b + 1]


def count(sass: str) -> list[LoopCount]:
    """The main loop of every ``qmv_mma_kernel`` instance in ``sass``."""
    found = []
    for name, text in functions(sass).items():
        if (args := template_args(name)) is None or (loop := main_loop(text)) is None:
            continue
        mix = Counter(opcode(i) for i in loop)
        steps = args["stages"]
        found.append(
            LoopCount(
                **args,
                per_step=len(loop) / steps,
                mma_per_step=mix["HMMA"] / steps,
                mix={op: n / steps for op, n in mix.most_common()},
            )
        )
    return sorted(found, key=lambda c: (c.mode, c.dtype, c.group_size, c.k_warps, c.tiles, c.extra))


def disassemble(lib: Path, cuobjdump: str = "cuobjdump", nvdisasm: str = "nvdisasm") -> str:
    """``nvdisasm -c`` of every cubin in ``lib`` (extracted with ``cuobjdump -xelf``)."""
    with tempfile.TemporaryDirectory() as tmp:
        _tool([cuobjdump, "-xelf", "all", str(lib.resolve())], tmp, "cuobjdump")
        cubins = sorted(Path(tmp).glob("*.cubin"))
        if not cubins:
            raise SystemExit(f"no cubin in {lib}")
        return "".join(_tool([nvdisasm, "-c", str(c)], tmp, "nvdisasm") for c in cubins)


def _tool(argv: list[str], cwd: str, package: str) -> str:
    """Run a CUDA binary tool; missing or failing is a one-line exit."""
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise SystemExit(
            f"{argv[0]} not found: CUDA's toolkit has it, or pip install nvidia-cuda-{package}"
        ) from None
    if done.returncode:
        raise SystemExit(f"{' '.join(argv[:2])} failed: {done.stderr.strip()[-400:]}")
    return done.stdout


def table(libraries: dict[str, list[LoopCount]], top: int = 8) -> str:
    """Markdown: per instance and library, instructions and MMAs per step, and the most
    frequent opcodes."""
    out = [
        "| library | mode | dtype | group | tiles | warps over K | per step | MMAs "
        "| most frequent |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, counts in libraries.items():
        for c in counts:
            mix = ", ".join(f"{op} {n:g}" for op, n in list(c.mix.items())[:top])
            out.append(
                f"| {name} | {c.mode} | {c.dtype} | {c.group_size} | "
                f"{tiles_cell(c.tiles, c.extra)} | {c.k_warps} | "
                f"{c.per_step:g} | {c.mma_per_step:g} | {mix} |"
            )
    return "\n".join(out) + "\n"
