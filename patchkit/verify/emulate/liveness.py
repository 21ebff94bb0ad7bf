"""Peak floating-point values live at once in one optimized LLVM IR function.

Why: a tile of V vectors keeps V inputs and V x 4 partial sums per thread; whether that
fits a GPU's registers is what a Metal compiler's register report would say, and no Apple
GPU is here. This counts, over the function clang -O2 made of the kernel (over the Metal
shim), the largest number of 32-bit floating-point words whose SSA values are live at
the same point: a lower bound on the registers they need, before any spilling decision
(floats and their vectors 1 per element, half and bfloat 1/2, double 2). A proxy: another
backend schedules differently, and integers, addresses and predicates are not counted.

Liveness is the textbook backward dataflow over the function's blocks: a value is live
from its definition to its last use on any path; a phi's incoming value is live at the
end of the block it comes from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_LABEL = re.compile(r"^([\w.$-]+):")
_DEF = re.compile(r"^\s+(%[\w.$-]+) = (.*)$")
_VALUE = re.compile(r"%[\w.$-]+")
_SUCCESSORS = re.compile(r"label (%[\w.$-]+)")
_PHI_IN = re.compile(r"\[\s*([^,\]]+),\s*(%[\w.$-]+)\s*\]")
_ELEMENT_WORDS = {"float": 1.0, "half": 0.5, "bfloat": 0.5, "double": 2.0}
_TYPE = r"(?:<(\d+) x (\w+)>|(\w+))"
# Where an instruction's result type stands, by opcode.
_AFTER_TO = re.compile(rf" to {_TYPE}")
_FLAGS = r"(?:(?:fast|nnan|ninf|nsz|arcp|contract|afn|reassoc|tail|musttail|notail)\s+)*"
_LEADING = re.compile(
    rf"^(?:fneg|fadd|fsub|fmul|fdiv|frem|phi|load|select i1 [^,]+,|insertelement|"
    rf"call|tail call)\s+{_FLAGS}(?:\w+\s+)*?{_TYPE}"
)


@dataclass
class _Block:
    name: str
    lines: list[str] = field(default_factory=list)
    successors: list[str] = field(default_factory=list)


def words(instruction: str) -> float:
    """32-bit floating-point words of the value an instruction defines (0: not floating)."""
    m = _AFTER_TO.search(instruction)
    if instruction.startswith("shufflevector"):
        elem = re.match(rf"shufflevector {_TYPE}", instruction)
        lanes = re.search(r", <(\d+) x i32>", instruction)
        if elem is None or lanes is None:
            return 0.0
        return int(lanes.group(1)) * _ELEMENT_WORDS.get(elem.group(2) or "", 0.0)
    if instruction.startswith("extractelement"):
        elem = re.match(rf"extractelement {_TYPE}", instruction)
        return _ELEMENT_WORDS.get(elem.group(2) or "", 0.0) if elem else 0.0
    if m is None or not re.match(r"(?:fptrunc|fpext|bitcast|sitofp|uitofp)\b", instruction):
        m = _LEADING.match(instruction)
    if m is None:
        return 0.0
    lanes, elem, scalar = m.groups()
    return int(lanes) * _ELEMENT_WORDS.get(elem, 0.0) if lanes else _ELEMENT_WORDS.get(scalar, 0.0)


def _blocks(function: str) -> list[_Block]:
    body = function.split("{", 1)[1].rsplit("}", 1)[0]
    blocks = [_Block("%entry")]
    for line in body.splitlines():
        if m := _LABEL.match(line):
            blocks.append(_Block("%" + m.group(1)))
        elif line.startswith("  ") and not line.lstrip().startswith(";"):
            blocks[-1].lines.append(line.split(" ; ", 1)[0].split(", !", 1)[0])
    for b in blocks:
        if b.lines:
            b.successors = _SUCCESSORS.findall(b.lines[-1])
    first = function.split("{", 1)[1].lstrip("\n")
    if not _LABEL.match(first):  # an unnamed entry block: its label is the function's
        return blocks
    return blocks[1:]


def peak_live_words(function: str) -> float:
    """The most floating-point words live at once in ``function`` (``define ... { ... }``)."""
    blocks = _blocks(function)
    weight: dict[str, float] = {}
    defs: dict[str, set[str]] = {}
    uses: dict[str, set[str]] = {}  # read before any definition in the block, phis aside
    phi_from: dict[str, dict[str, set[str]]] = {}  # block -> predecessor -> values
    for b in blocks:
        defined: set[str] = set()
        used: set[str] = set()
        for line in b.lines:
            m = _DEF.match(line)
            text = m.group(2) if m else line.strip()
            if text.startswith("phi "):
                for value, pred in _PHI_IN.findall(text):
                    vals = set(_VALUE.findall(value))
                    phi_from.setdefault(b.name, {}).setdefault(pred, set()).update(vals)
            else:
                used |= {v for v in _VALUE.findall(text) if v not in defined}
            if m:
                defined.add(m.group(1))
                weight[m.group(1)] = words(text)
        defs[b.name], uses[b.name] = defined, used
    live_in: dict[str, set[str]] = {b.name: set() for b in blocks}
    live_out: dict[str, set[str]] = {b.name: set() for b in blocks}
    changed = True
    while changed:
        changed = False
        for b in reversed(blocks):
            out: set[str] = set()
            for s in b.successors:
                out |= live_in.get(s, set()) | phi_from.get(s, {}).get(b.name, set())
            new_in = uses[b.name] | (out - defs[b.name])
            if out != live_out[b.name] or new_in != live_in[b.name]:
                live_out[b.name], live_in[b.name], changed = out, new_in, True
    peak = 0.0
    for b in blocks:
        live = set(live_out[b.name])
        peak = max(peak, sum(weight.get(v, 0.0) for v in live))
        for line in reversed(b.lines):
            m = _DEF.match(line)
            if m:
                live.discard(m.group(1))
            text = m.group(2) if m else line.strip()
            if not text.startswith("phi "):
                live |= set(_VALUE.findall(text))
            peak = max(peak, sum(weight.get(v, 0.0) for v in live))
    return peak
