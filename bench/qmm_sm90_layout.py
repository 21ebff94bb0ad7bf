"""How the host and NVRTC lay out MLX's `qmm_sm90` kernel parameters: no GPU needed.

    python3 bench/qmm_sm90_layout.py [--mlx-repo MLX] [--rev REV] [--cutlass DIR] \
        [--cccl DIR] [--nvrtc LIBNVRTC] [--json PAGE.json --md PAGE.md]

MLX compiles `qmm_sm90` at run time with NVRTC, and fills the kernel's one parameter,
CUTLASS's `Params`, on the host, compiled by nvcc. The two must agree on its layout: the
driver copies the size the kernel declares from the host's object. CUTLASS's TMA
descriptor type is cuda.h's `CUtensorMap` on the host and a stand-in of its own under
NVRTC (`include/cute/arch/copy_sm90_desc.hpp`). This compiles one instance of MLX's kernel
(float16, 4-bit, group 128, tile 128x128x64) four ways and reads the layout each sees:

- `host`: nvcc and the toolkit's cuda.h, a program that prints the layout;
- `nvrtc`: NVRTC with MLX's JIT options, the same header and a device array holding the
  layout, and the kernel's `.param` line in its PTX;
- `host, CUtensorMap at 64` (control): the host with a copy of cuda.h whose `CUtensorMap`
  is 64-byte aligned, as CUDA 12 declares it: it must lay `Params` out as `nvrtc` does;
- `nvrtc, stand-in at 128` (control): NVRTC with CUTLASS's stand-in 128-byte aligned: it
  must lay `Params` out as `host` does.

Both controls as they must be, the verdict says whether `host` and `nvrtc` agree (exit 0
either way); a control that comes out otherwise is exit 1; a missing tool or a compile
that fails, exit 2. MLX's header comes from a clone (``--mlx-repo``, default
``PATCHKIT_MLX_REPO``) at ``--rev`` (default pin.toml's commit); CUTLASS and CCCL from
``patchkit deps``'s folder.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HEADER = "mlx/backend/cuda/device/qmm_sm90.cuh"
STAND_IN = "cute/arch/copy_sm90_desc.hpp"
INSTANCE = (
    "mlx::core::cu::qmm_sm90_kernel_t<128, cutlass::half_t, cutlass::uint4b_t, "
    "cute::Shape<cute::Int<128>, cute::Int<128>, cute::Int<64>>>"
)
KERNEL = f"cutlass::device_kernel<{INSTANCE}>"
# What each side reports, in this order.
FIELDS = ("descriptor_align", "descriptor_size", "params_size", "params_align",
          "mainloop_at", "epilogue_at", "hw_info_at", "scheduler_at")  # fmt: skip
VALUES = """
    alignof(cute::TmaDescriptor), sizeof(cute::TmaDescriptor),
    sizeof(P), alignof(P),
    offsetof(P, mainloop), offsetof(P, epilogue),
    offsetof(P, hw_info), offsetof(P, scheduler)"""
HOST_PROGRAM = f"""#include "{HEADER}"
#include <cstddef>
#include <cstdio>
using P = {INSTANCE}::Params;
int main() {{
  unsigned long long v[] = {{{VALUES}}};
  for (auto x : v) std::printf("%llu\\n", x);
}}
"""
NVRTC_PROBE = f"""
#include <cuda/std/cstddef>
using P = {INSTANCE}::Params;
extern "C" __device__ unsigned long long patchkit_layout[] = {{{VALUES}}};
"""
# cuda.h's CUtensorMap alignment (CUDA 13: 128) and CUTLASS's stand-in under NVRTC.
CUDA_H_ALIGN = re.compile(r"(typedef struct CUtensorMap_st \{\s*#if[^\n]*\n\s*)alignas\(128\)")
STAND_IN_DECL = "struct alignas(64) { char bytes[128]; }"


class CannotRun(Exception):
    """A tool or input is missing, or a compiler refuses the source: one line, exit 2."""


def nvcc_path(given: str | None) -> str:
    """nvcc: ``given`` or the one on PATH."""
    found = shutil.which(given or "nvcc")
    if not found:
        raise CannotRun(f"{given or 'nvcc'} not found: put CUDA's bin on PATH or pass --nvcc")
    return found


def toolkit_dirs(nvcc: str) -> tuple[Path, Path]:
    """nvcc's toolkit folder and its include folder, as nvcc itself reports them (nvcc
    may be a wrapper script outside the toolkit)."""
    out = subprocess.run([nvcc, "--dryrun", "-x", "cu", "-c", os.devnull],
                         capture_output=True, text=True).stderr  # fmt: skip
    top = re.search(r"^#\$ TOP=(.*)$", out, re.M)
    inc = re.search(r'^#\$ INCLUDES="-I([^"]*)"', out, re.M)
    if not (top and inc):
        raise CannotRun(f"{nvcc} --dryrun names no toolkit folder")
    return Path(top.group(1).strip()).resolve(), Path(inc.group(1).strip()).resolve()


def find_nvrtc(given: str | None, toolkit: Path) -> str:
    """libnvrtc: ``given``, else the toolkit's, else a pip wheel's (``nvidia-cuda-nvrtc``)
    in this Python's site-packages."""
    if given:
        if not Path(given).is_file():
            raise CannotRun(f"--nvrtc {given}: no such file")
        return given
    candidates = sorted(glob.glob(str(toolkit / "lib64" / "libnvrtc.so*")))
    for site in sys.path:  # nvidia-cuda-nvrtc 13 (nvidia/cu13) and 12 (nvidia/cuda_nvrtc)
        for sub in ("cu*", "cuda_nvrtc"):
            candidates += sorted(
                glob.glob(os.path.join(site, "nvidia", sub, "lib", "libnvrtc.so.*"))
            )
    candidates = [c for c in candidates if "builtins" not in c and ".alt." not in c]
    if not candidates:
        raise CannotRun("libnvrtc not found beside nvcc or in site-packages: pass --nvrtc "
                      "or pip install nvidia-cuda-nvrtc")  # fmt: skip
    return candidates[0]


def header_tree(repo: str, rev: str, into: Path) -> Path:
    """MLX's ``HEADER`` at ``rev``, in a folder laid out as MLX's tree."""
    proc = subprocess.run(["git", "-C", repo, "show", f"{rev}:{HEADER}"],
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        raise CannotRun(f"{HEADER} not at {rev} in {repo}: {proc.stderr.strip()}")
    (into / HEADER).parent.mkdir(parents=True, exist_ok=True)
    (into / HEADER).write_text(proc.stdout)
    return into


def cuda_h_at_64(include: Path, into: Path) -> Path:
    """A folder holding a copy of the toolkit's cuda.h with ``CUtensorMap`` 64-byte
    aligned, as CUDA 12 declares it (first on the include path, it replaces cuda.h)."""
    text = (include / "cuda.h").read_text()
    changed, n = CUDA_H_ALIGN.subn(r"\1alignas(64)", text)
    if n != 1:
        raise CannotRun("this toolkit's cuda.h does not align CUtensorMap to 128 bytes as "
                      "CUDA 13 does: nothing to simulate")  # fmt: skip
    into.mkdir(parents=True, exist_ok=True)
    (into / "cuda.h").write_text(changed)
    return into


def stand_in_at_128(cutlass: Path, into: Path) -> Path:
    """A folder whose copy of CUTLASS's ``STAND_IN`` aligns the NVRTC stand-in to 128."""
    text = (cutlass / STAND_IN).read_text()
    if STAND_IN_DECL not in text:
        raise CannotRun(f"{STAND_IN} declares no `{STAND_IN_DECL}`: another CUTLASS")
    (into / STAND_IN).parent.mkdir(parents=True, exist_ok=True)
    (into / STAND_IN).write_text(
        text.replace(STAND_IN_DECL, "struct alignas(128) { char bytes[128]; }")
    )
    return into


def host_layout(nvcc: str, includes: list[Path], work: Path, name: str) -> dict[str, int]:
    """Compile and run the host program; its printed layout."""
    src = work / f"{name}.cu"
    src.write_text(HOST_PROGRAM)
    exe = work / name
    argv = [nvcc, "-std=c++20", "--expt-relaxed-constexpr", "-arch=sm_90a", "-w",
            *[f"-I{p}" for p in includes], str(src), "-o", str(exe)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CannotRun(f"nvcc failed on the host program: {proc.stderr.strip()[-400:]}")
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    return dict(zip(FIELDS, map(int, out.split()), strict=True))


def load_nvrtc(lib: str) -> ctypes.CDLL:
    """libnvrtc, with the builtins library beside it loaded first: NVRTC opens it by name
    at compile time, which a wheel's folder off the loader's path would not satisfy."""
    for builtins in sorted(Path(lib).parent.glob("libnvrtc-builtins.so*")):
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(lib)


def nvrtc_layout(
    nvrtc: ctypes.CDLL, source: str, includes: list[Path]
) -> tuple[dict[str, int], str]:
    """Compile ``source`` and the probe with NVRTC as MLX's JIT does (compute_90a: PTX);
    the layout array's values, and the kernel's ``.param`` declaration."""
    prog = ctypes.c_void_p()
    code = (source + NVRTC_PROBE).encode()
    _check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(prog), code, b"qmm_sm90.cu", 0, None, None))
    _check(nvrtc, nvrtc.nvrtcAddNameExpression(prog, KERNEL.encode()))
    opts = [b"--device-as-default-execution-space", b"--gpu-architecture=compute_90a",
            *[f"--include-path={p}".encode() for p in includes]]  # fmt: skip
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    if rc != 0:
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise CannotRun(f"NVRTC failed: {log.value.decode(errors='replace').strip()[:600]}")
    lowered = ctypes.c_char_p()
    _check(nvrtc, nvrtc.nvrtcGetLoweredName(prog, KERNEL.encode(), ctypes.byref(lowered)))
    size = ctypes.c_size_t()
    _check(nvrtc, nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)))
    ptx = ctypes.create_string_buffer(size.value)
    _check(nvrtc, nvrtc.nvrtcGetPTX(prog, ptx))
    text = ptx.value.decode()
    return parse_layout(text), parse_param(text, lowered.value.decode())


def _check(nvrtc: ctypes.CDLL, rc: int) -> None:
    if rc != 0:
        nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise CannotRun(f"NVRTC: {nvrtc.nvrtcGetErrorString(rc).decode()}")


def parse_layout(ptx: str) -> dict[str, int]:
    """The values of the probe's ``patchkit_layout`` array in PTX, which declares it as
    64-bit words or as their bytes (little-endian)."""
    m = re.search(r"\.(b8|b64|u64)\s+patchkit_layout\[\d+\]\s*=\s*\{([^}]*)\}", ptx)
    if not m:
        raise ValueError("no patchkit_layout array in the PTX")
    items = [int(v) for v in m.group(2).split(",")]
    if m.group(1) == "b8":
        items = [int.from_bytes(bytes(items[i : i + 8]), "little") for i in range(0, len(items), 8)]
    return dict(zip(FIELDS, items, strict=True))


def parse_param(ptx: str, entry: str) -> str:
    """The first ``.param`` of ``.entry`` ``entry``: alignment and size, mangling dropped."""
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\(\s*(\.param[^\n]*?)\s*[,)\n]", ptx)
    if not m:
        raise ValueError(f"no .entry {entry} in the PTX")
    return re.sub(r"\s+\S+_param_0\[", " param_0[", m.group(1)).strip()


def verdict(arms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Whether host and NVRTC agree, and whether each control came out as it must."""

    def same(a: str, b: str) -> bool:
        return arms[a]["layout"] == arms[b]["layout"]

    controls = {
        "host with CUtensorMap at 64 lays Params out as nvrtc": same("host_at_64", "nvrtc"),
        "nvrtc with the stand-in at 128 lays Params out as host": same("nvrtc_at_128", "host"),
    }
    return {"host_and_nvrtc_agree": same("host", "nvrtc"), "controls": controls,
            "controls_as_they_must_be": all(controls.values())}  # fmt: skip


ARM_NAMES = {
    "host": "host (nvcc, the toolkit's cuda.h)",
    "nvrtc": "nvrtc (MLX's JIT options)",
    "host_at_64": "host, CUtensorMap at 64 (control)",
    "nvrtc_at_128": "nvrtc, stand-in at 128 (control)",
}


def page(report: dict[str, Any]) -> str:
    """The results page: the four layouts side by side, the verdict, how it was made."""
    v = report["verdict"]
    agree = "agree" if v["host_and_nvrtc_agree"] else "disagree"
    lines = [
        "# qmm_sm90's kernel parameters: host against NVRTC",
        "",
        f"**What this is.** MLX's `qmm_sm90` instance `{INSTANCE}` compiled four ways, no GPU: "
        "each side's layout of the kernel's one parameter (CUTLASS's `Params`, which the host "
        "fills and the driver copies to the kernel by the size the kernel declares). A "
        "compile-time fact, read from the compilers; what it does to results on a GPU is "
        "MLX's tests' to show (`docs/cuda.md`).",
        "",
        f"- Verdict: host and NVRTC **{agree}**; controls "
        + ("as they must be." if v["controls_as_they_must_be"] else "**not** as they must be."),
        *[f"  - {name}: {'yes' if ok else 'no'}" for name, ok in v["controls"].items()],
        f"- Toolchain: nvcc {report['nvcc'].removeprefix('Build ')}; NVRTC "
        f"{report['nvrtc_version']}; CUTLASS {report['cutlass']}; CCCL {report['cccl']}; "
        f"MLX {report['mlx_rev'][:8]}.",
        f"- Command: `{report['command']}`",
        "",
        "| arm | descriptor align / size | Params size / align | mainloop | epilogue | hw_info "
        "| scheduler | kernel's `.param` |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, arm in report["arms"].items():
        lay = arm["layout"]
        lines.append(
            f"| {ARM_NAMES[key]} | {lay['descriptor_align']} / {lay['descriptor_size']} | "
            f"{lay['params_size']} / {lay['params_align']} | {lay['mainloop_at']} | "
            f"{lay['epilogue_at']} | {lay['hw_info_at']} | {lay['scheduler_at']} | "
            f"{('`' + arm['param'] + '`') if arm.get('param') else '-'} |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Compile the four arms; the report."""
    from patchkit.carry import mlx_deps, pin

    nvcc = nvcc_path(args.nvcc)
    toolkit, include = toolkit_dirs(nvcc)
    nvrtc = load_nvrtc(find_nvrtc(args.nvrtc, toolkit))
    deps = mlx_deps.deps_root()
    cutlass = Path(args.cutlass or deps / "cutlass" / "include")
    cccl = Path(args.cccl or deps / "cccl" / "include")
    for what, path in (("CUTLASS", cutlass), ("CCCL", cccl)):
        if not path.is_dir():
            raise CannotRun(
                f"{what} headers not at {path}: run `patchkit deps --from DIR` or pass them"
            )
    repo = args.mlx_repo or os.environ.get("PATCHKIT_MLX_REPO")
    if not repo:
        raise CannotRun("no MLX clone: pass --mlx-repo or set PATCHKIT_MLX_REPO")
    rev = args.rev or pin.load(ROOT / "pin.toml").commit
    with tempfile.TemporaryDirectory(prefix="qmm-sm90-layout-") as tmp:
        work = Path(tmp)
        mlx = header_tree(repo, rev, work / "mlx")
        source = (mlx / HEADER).read_text()
        at_64 = cuda_h_at_64(include, work / "cuda-h-at-64")
        at_128 = stand_in_at_128(cutlass, work / "stand-in-at-128")
        jit = [cutlass, cccl, include]
        arms: dict[str, dict[str, Any]] = {
            "host": {"layout": host_layout(nvcc, [mlx, cutlass], work, "host")},
            "nvrtc": dict(zip(("layout", "param"), nvrtc_layout(nvrtc, source, jit), strict=True)),
            "host_at_64": {"layout": host_layout(nvcc, [at_64, mlx, cutlass], work, "host64")},
            "nvrtc_at_128": dict(
                zip(("layout", "param"), nvrtc_layout(nvrtc, source, [at_128, *jit]), strict=True)
            ),
        }
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    # Where the headers came from: patchkit deps' stamps, as build records name them.
    stamped = {n: deps / n for n in ("cutlass", "cccl") if (deps / n / mlx_deps.STAMP).is_file()}
    sources = mlx_deps.stamps(stamped)
    nvcc_version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    return {
        "instance": INSTANCE,
        "arms": arms,
        "verdict": verdict(arms),
        "nvcc": nvcc_version.strip().splitlines()[-1],
        "nvrtc_version": f"{major.value}.{minor.value}",
        "cutlass": str(cutlass) if args.cutlass else sources.get("cutlass", "?"),
        "cccl": str(cccl) if args.cccl else sources.get("cccl", "?"),
        "mlx_rev": rev,
        "command": shown_command(sys.argv[1:]),
    }


# Options naming this host's tools and clones: the page's command leaves them out.
HOST_OPTIONS = ("--mlx-repo", "--nvrtc", "--nvcc", "--cutlass", "--cccl")


def shown_command(args: list[str]) -> str:
    """The command as the page shows it: no host paths (options of ``HOST_OPTIONS`` and
    their values dropped; output files relative to the checkout where they are in it)."""
    shown, skip = [], False
    for arg in args:
        option, eq, value = arg.partition("=")
        if skip:
            skip = False
        elif option in HOST_OPTIONS:
            skip = not eq
        elif option in ("--json", "--md"):
            shown.append(arg if not eq else option)
            if eq:
                shown.append(_relative(value))
        else:
            shown.append(_relative(arg) if shown and shown[-1] in ("--json", "--md") else arg)
    return "python3 bench/qmm_sm90_layout.py " + shlex.join(shown)


def _relative(path: str) -> str:
    full = Path(path).resolve()
    return str(full.relative_to(ROOT)) if full.is_relative_to(ROOT) else full.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mlx-repo", help="an MLX clone (default: PATCHKIT_MLX_REPO)")
    ap.add_argument("--rev", help="MLX commit to read the kernel's header at (default: the pin)")
    ap.add_argument("--cutlass", help="CUTLASS's include folder (default: patchkit deps)")
    ap.add_argument("--cccl", help="CCCL's include folder (default: patchkit deps)")
    ap.add_argument("--nvcc", help="nvcc (default: on PATH)")
    ap.add_argument("--nvrtc", help="libnvrtc.so (default: beside nvcc, or a pip wheel's)")
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("--md", type=Path, help="and its page here")
    args = ap.parse_args()
    try:
        report = run(args)
    except CannotRun as exc:
        print(f"qmm_sm90_layout: {exc}", file=sys.stderr)
        sys.exit(2)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    text = page(report)
    if args.md:
        args.md.write_text(text)
    print(text, end="")
    sys.exit(0 if report["verdict"]["controls_as_they_must_be"] else 1)


if __name__ == "__main__":
    main()
