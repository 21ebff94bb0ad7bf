"""What the patched ``qmv.cu`` costs MLX's CUDA build: object size and compile time.

MLX compiles ``qmv.cu`` once per architecture its wheels ship (the pinned ``setup.py``'s
``cuda_archs``), each an object whose ``.nv_fatbin`` section holds the device code that
lands in ``libmlx.so``. Compiling the pin's file and the patched one the same way, one
architecture at a time, gives what the PR adds to the library and to a build, with no GPU:
the two arms of an architecture run at once, so both see the same load on the machine.

Proxies, said on the page: one file's object, not the linked library (the other patched
CUDA files are host code: ``qmm.h``'s declarations, ``quantized.cpp``'s route and
``qmm.cu``'s guard), and wall time on whatever machine runs it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from patchkit.carry import mlx_build
from patchkit.verify.harness import cuda

ARMS = ("stock", "patched")
SETUP_PY = "setup.py"
CUDA_CMAKE = "mlx/backend/cuda/CMakeLists.txt"
# readelf -S -W: "[Nr] Name Type Address Off Size ..." (hex fields), one section a line.
SECTION = re.compile(r"^\s*\[\s*\d+\]\s+(\S+)\s+\S+\s+[0-9a-f]+\s+[0-9a-f]+\s+([0-9a-f]+)\s", re.M)
FATBIN = ".nv_fatbin"


def wheel_archs(setup_py: str) -> list[str]:
    """``MLX_CUDA_ARCHITECTURES`` entries of MLX's setup.py, in order."""
    block = setup_py[setup_py.index("cuda_archs = [") : setup_py.index("MLX_CUDA_ARCHITECTURES")]
    return re.findall(r'"(\d+a?-(?:real|virtual))"', block)


def gencode(arch: str) -> str:
    """nvcc's -gencode for one CMake architecture; a virtual one is also run through ptxas
    (``code=sm_XX``), as a driver's JIT would compile its PTX."""
    num = arch.split("-")[0]
    return f"arch=compute_{num},code=sm_{num}"


def object_command(
    flags: Sequence[str], source: Path, arch: str, out: Path, nvcc: str = "nvcc"
) -> list[str]:
    """nvcc -c of one MLX .cu file for one architecture, with MLX's flags and includes."""
    return [nvcc, *flags, "-gencode", gencode(arch), "-c", str(source), "-o", str(out)]


def section_bytes(readelf_sections: str, name: str = FATBIN) -> int | None:
    """The size of section ``name`` in ``readelf -S -W`` output; None when absent."""
    sizes = {m[1]: int(m[2], 16) for m in SECTION.finditer(readelf_sections)}
    return sizes.get(name)


def fatbin_bytes(obj: Path) -> int | None:
    """Device code an object carries (its ``.nv_fatbin`` section)."""
    proc = subprocess.run(["readelf", "-S", "-W", str(obj)], capture_output=True, text=True)
    return section_bytes(proc.stdout) if proc.returncode == 0 else None


def compile_pair(commands: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Start each arm's compile at once; {arm: {seconds, returncode, log}} as each ends."""
    started = time.perf_counter()
    procs = {arm: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for arm, cmd in commands.items()}  # fmt: skip
    done = {}
    for arm, proc in procs.items():
        log = proc.communicate()[0].decode(errors="replace")
        done[arm] = {"seconds": time.perf_counter() - started, "returncode": proc.returncode,
                     "log": log[-4000:]}  # fmt: skip
    return done


def measure(
    sources: dict[str, Path], flags: dict[str, list[str]], archs: Sequence[str], work: Path
) -> list[dict[str, Any]]:
    """One row per architecture: each arm's compile seconds, object and fatbin bytes.
    ``sources``/``flags``: per arm, the ``qmv.cu`` and the flags of its tree. A failed
    compile stops the run with its log's tail (a cost of a file that does not build is none).
    """
    rows = []
    for arch in archs:
        outs = {arm: work / f"{arm}.{arch}.o" for arm in ARMS}
        commands = {arm: object_command(flags[arm], sources[arm], arch, outs[arm]) for arm in ARMS}
        ran = compile_pair(commands)
        for arm, result in ran.items():
            if result["returncode"]:
                raise RuntimeError(f"nvcc {arm} {arch} failed:\n{result['log']}")
        rows.append({"arch": arch, **{arm: {
            "seconds": round(ran[arm]["seconds"], 1),
            "object_bytes": outs[arm].stat().st_size,
            "fatbin_bytes": fatbin_bytes(outs[arm]),
        } for arm in ARMS}})  # fmt: skip
        print(f"{arch}: " + ", ".join(
            f"{arm} {rows[-1][arm]['seconds']} s {rows[-1][arm]['fatbin_bytes']} B" for arm in ARMS
        ), flush=True)  # fmt: skip
    return rows


def host() -> dict[str, Any]:
    """The machine the compiles ran on and the nvcc that ran them."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    version = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    return {"cpu": cpu, "cpus": os.cpu_count(), "nvcc": version.strip().splitlines()[-1]}


def record(rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """The page's JSON: the rows, their totals over the architectures, and ``meta``
    (command, machine, pin, build inputs)."""
    keys = ("seconds", "object_bytes", "fatbin_bytes")
    totals = {arm: {k: sum(r[arm][k] or 0 for r in rows) for k in keys} for arm in ARMS}
    for arm in ARMS:
        totals[arm]["seconds"] = round(totals[arm]["seconds"], 1)
    return {**meta, "rows": rows, "totals": totals}


def _ratio(new: float | None, old: float | None) -> str:
    return f"{new / old:.2f}x" if new and old else "n/a"


def _mib(n: int | None) -> str:
    return f"{n / 2**20:.2f}" if n is not None else "n/a"


def _row(name: str, s: dict[str, Any], p: dict[str, Any]) -> str:
    """One table row: stock's and the patched arm's device code and compile seconds."""
    code = (s["fatbin_bytes"], p["fatbin_bytes"])
    seconds = (s["seconds"], p["seconds"])
    return (
        f"| {name} | {_mib(code[0])} | {_mib(code[1])} | {_ratio(code[1], code[0])} "
        f"| {seconds[0]} | {seconds[1]} | {_ratio(seconds[1], seconds[0])} |"
    )


def page(data: dict[str, Any]) -> str:
    """The Markdown page of a :func:`record`."""
    rows, totals = data["rows"], data["totals"]
    head = [
        "# The CUDA PR's `qmv.cu`: what it adds to MLX's library and build time",
        "",
        f"- MLX {data['mlx_commit'][:8]}'s `{cuda.QMV_PATH}` (stock) and the same tree with "
        "the series' CUDA files rendered (patched), each compiled to an object per "
        "architecture MLX's CUDA wheels ship (`setup.py`'s `cuda_archs`), with MLX's nvcc "
        "flags and includes; the two arms of an architecture at once, architectures one "
        "after another.",
        mlx_build.valid_while("cuda", data["build_inputs_sha256"]),
        f"- Machine: {data['host']['cpu']}, {data['host']['cpus']} CPUs; {data['host']['nvcc']}.",
        "- Device code: the object's `.nv_fatbin` section (compressed as MLX's flags ask), "
        "what `libmlx.so` carries of the file for that architecture. A proxy for the "
        "library: one file's objects, not the linked library; the PR's other CUDA files are "
        "host code (declarations, a route, a guard). Seconds: wall time of each arm's "
        "`nvcc -c`, one core each, beside the other arm's.",
        f"- Command: `{data['command']}`",
        "",
        "| architecture | device code, stock (MiB) | patched (MiB) | patched / stock "
        "| compile, stock (s) | patched (s) | patched / stock |",
        "|---|---|---|---|---|---|---|",
    ]
    body = [_row(r["arch"], r["stock"], r["patched"]) for r in rows]
    s, p = totals["stock"], totals["patched"]
    body.append(_row(f"all {len(rows)}", s, p))
    grown = (p["fatbin_bytes"] or 0) - (s["fatbin_bytes"] or 0)
    tail = [
        "",
        f"Over the {len(rows)} architectures the library carries {_mib(grown)} MiB more device "
        f"code for this file, and compiling it for all of them takes "
        f"{p['seconds'] - s['seconds']:.1f} s more (MLX's build hands one nvcc call every "
        "architecture of a file, which compiles them one after another). Raw: "
        "[its JSON](" + data["name"] + ".json).",
    ]
    return "\n".join([*head, *body, *tail]) + "\n"


def write(data: dict[str, Any], out: Path) -> None:
    """``out``.json and ``out``.md, side by side."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(page(data))
