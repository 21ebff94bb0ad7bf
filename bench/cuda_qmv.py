"""The pin's and the patched qmv.cu, compiled and run side by side on one CUDA GPU.

  build (here: nvcc, the pinned tree)  python3 bench/cuda_qmv.py build --out .device/qmv \
                                           [--variant NAME=T,S,W,KW,WN,WKW[,WXN,WXT,WXS] ...] \
                                           [--template-variant NAME=DIFF[:CONSTANTS] ...]
  run   (on the GPU host: torch)       python3 bench/cuda_qmv.py run --libs .device/qmv \
                                           --json results.json [--deadline SECONDS] [--quick] \
                                           [--dtypes bfloat16 float16] [--groups 64 32 128]
  report (anywhere)                    python3 bench/cuda_qmv.py report results.json
  compare (GPU host)                   python3 bench/cuda_qmv.py compare --libs .device/qmv \
                                           --json variants.json [--group-size 64] \
                                           [--shapes 8192x16896,8192x28672]
  compare-summary (anywhere)           python3 bench/cuda_qmv.py compare-summary g128.json \
                                           g64.json [--min-n 8192] [--by-layer ARM]
  resources (here: cuobjdump)          python3 bench/cuda_qmv.py resources --libs .device/qmv \
                                           --out docs/results/cuda-kernel-resources
  sass (here: cuobjdump, nvdisasm)     python3 bench/cuda_qmv.py sass --libs .device/qmv \
                                           [--mode 'affine 4-bit'] [--dtype bfloat16] \
                                           [--json sass.json]
  profile (GPU host, under Nsight Compute)
      ncu -k regex:qmv --launch-skip 1 --launch-count 1 python3 bench/cuda_qmv.py profile \
          --lib .device/qmv/patched.so --K 8192 --N 28672 --bits 4 [--m M]
``build`` renders the patched qmv.cu from the templates and compiles both arms with MLX's
own nvcc flags and include directories (patchkit.verify.harness.cuda says how); ``run``
checks every row of the patched calls at M = 1..16 (and 17, 33) bit for bit against the
patched M = 1 call of the same vector, measures each arm's M = 1 error against a float32
reference, and times both arms with cold weights; ``report`` makes its tables
(``docs/results/cuda-kernel-stock.md``).
``--variant`` adds libraries of the patched file with other launch constants
(``variants/NAME.so``; any other build's ``patched.so`` copied there is compared too);
``--template-variant`` adds one of the patched file rendered from a copy of the templates
with a ``git diff`` of them applied (a kernel experiment kept as a reviewable diff,
``bench/variants/*.diff``), with the launch constants its source declares or those given
after ``:``. ``compare`` checks the rows of each and of the shipped file (against its own
M = 1, and against the M = 1 of the shipped kernel or another variant with the same warps
over K, which sums every vector in the same order; a variant of other warps is the control
that must differ) and times them all beside stock's kernel (``compare-summary`` puts
several such runs in one table); a template variant whose diff declares its own summation
order in its header (``cuda.OWN_ORDER``) is held to its own M = 1 only. ``resources``
reads registers, spills and shared memory of the patched library's tensor-core instances
(``patchkit.verify.harness.cuda_resources``); ``sass`` counts the instructions one step of
K issues in each instance's main loop, and their opcodes (``cuda_sass``): a static proxy
for kernel work without a GPU. See docs/results/cuda-kernel.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from patchkit.verify.harness import cuda, cuda_resources, cuda_sass

ROOT = Path(__file__).resolve().parents[1]
BUILD_META = "build.json"  # under --out: what build compiled, and with which nvcc


def rendered_qmv(read: Callable[[str], str], diff: Path | None = None) -> str:
    """The patched qmv.cu, rendered from this checkout's templates, or from a copy of them
    with ``diff`` (a ``git diff`` of ``templates/``) applied: an experiment renders without
    touching the checkout. The copy sits in a repository of its own, so ``git apply``
    never resolves its paths against an enclosing one."""
    from patchkit.carry import render
    from patchkit.errors import ToolError
    from patchkit.util import git

    with tempfile.TemporaryDirectory() as tmp:
        templates = ROOT / "templates"
        if diff is not None:
            if not diff.is_file():
                raise SystemExit(f"template variant: no diff at {diff}")
            templates = Path(tmp) / "templates"
            shutil.copytree(ROOT / "templates", templates)
            git.init(Path(tmp))
            try:
                git.run(tmp, "apply", str(diff.resolve()))
            except ToolError as exc:
                why = (exc.stderr.strip().splitlines() or ["git apply failed"])[0]
                raise SystemExit(
                    f"{diff} does not apply to this checkout's templates: {why}"
                ) from None
        plan = next(p for p in render.load_plans(templates) if p.path == cuda.QMV_PATH)
        return render.render_file(plan, read(cuda.QMV_PATH), render.RenderOptions())


# Launch constants as typed: the first six, or all of cuda.LAUNCH_CONSTANTS (the last three
# give wide layers of more than WXN rows WXT tiles and WXS slots).
CONSTANTS_HELP = "T,S,W,KW,WN,WKW[,WXN,WXT,WXS]"


def parse_constants(text: str) -> list[int] | None:
    """``text`` as :data:`CONSTANTS_HELP`, all nine constants; None when it is not that."""
    parts = text.split(",")
    counts = (cuda.SAME_TILES_EVERYWHERE, len(cuda.LAUNCH_CONSTANTS))
    if len(parts) not in counts or not all(p.isdigit() for p in parts):
        return None
    return cuda.full_launch_constants([int(p) for p in parts])


RESERVED = ("stock", "patched", cuda.SHIPPED)  # the arms' own library names


def template_variant(spec: str, taken: Collection[str]) -> tuple[str, Path, list[int] | None]:
    """``NAME=DIFF[:CONSTANTS]`` as (name, diff, launch constants or None); a bad
    spec is a one-line exit. The constants are what follows the last ``:`` when it is six
    or nine numbers, so a diff's path may hold ``:`` itself."""
    name, eq, rest = spec.partition("=")
    if not eq or not re.fullmatch(r"\w+", name) or not rest:
        raise SystemExit(f"--template-variant {spec!r}: give NAME=DIFF[:CONSTANTS]")
    if name in RESERVED or name in taken:
        raise SystemExit(f"--template-variant {spec!r}: the name {name!r} is taken")
    head, colon, tail = rest.rpartition(":")
    if colon and (values := parse_constants(tail)):
        return name, Path(head), values
    return name, Path(rest), None


def launch_variant(spec: str, taken: Collection[str]) -> tuple[str, list[int]]:
    """``NAME=CONSTANTS`` (:data:`CONSTANTS_HELP`) as (name, all nine constants); a bad
    spec is a one-line exit."""
    name, _, text = spec.partition("=")
    if not re.fullmatch(r"\w+", name):
        raise SystemExit(f"--variant {spec!r}: give NAME={CONSTANTS_HELP}")
    if name in RESERVED or name in taken:
        raise SystemExit(f"--variant {spec!r}: the name {name!r} is taken")
    if (values := parse_constants(text)) is None:
        raise SystemExit(f"--variant {spec!r}: give NAME={CONSTANTS_HELP}")
    return name, values


def build(out: Path, arch: str, variants: list[str], template_variants: list[str]) -> None:
    """Extract the pinned tree, render the patched qmv.cu, compile both libraries (and one
    per ``NAME=CONSTANTS`` variant and per ``NAME=DIFF`` template variant)."""
    from patchkit.carry import mlx_deps, pin, source
    from patchkit.util import git

    constants: dict[str, list[int]] = {}
    for spec in variants:
        name, values = launch_variant(spec, constants)
        constants[name] = values
    deps = mlx_deps.deps_root()
    if missing := cuda.missing_deps(deps):
        raise SystemExit(f"MLX's configure-time sources missing: {', '.join(missing)}")
    sha = pin.load(Path("pin.toml")).commit
    clone = source.ensure_clone(os.environ.get("PATCHKIT_MLX_REPO") or pin.UPSTREAM_URL)
    read = source.reader(clone, sha)
    root = out / "mlx-pin"
    if not (root / cuda.QMV_PATH).exists():
        git.export(clone, sha, root, ["mlx"])
    patched = out / "qmv_patched.cu"
    patched.write_text(rendered_qmv(read))
    flags = cuda.mlx_flags(read("mlx/backend/cuda/CMakeLists.txt"), root.resolve(), deps)
    sources = {"stock": root / cuda.QMV_PATH, "patched": patched}
    for name, values in constants.items():
        source = out / f"qmv_{name}.cu"
        source.write_text(cuda.with_launch_constants(patched.read_text(), values))
        sources[f"variants/{name}"] = source
    diffs = {}  # what each template variant was rendered from: compare's page records it
    for spec in template_variants:
        name, diff, values = template_variant(spec, constants)
        text = rendered_qmv(read, diff)
        if values:
            text = cuda.with_launch_constants(text, values)
        if text == patched.read_text():
            raise SystemExit(f"--template-variant {spec!r}: renders the shipped kernel itself")
        source = out / f"qmv_{name}.cu"
        source.write_text(text)
        constants[name] = cuda.launch_constants(text)
        sources[f"variants/{name}"] = source
        digest = hashlib.sha256(diff.read_bytes()).hexdigest()
        own = cuda.declares_own_order(diff.read_text())
        diffs[name] = {"diff": diff.as_posix(), "sha256": digest, "own_order": own}
    constants[cuda.SHIPPED] = cuda.launch_constants(patched.read_text())
    (out / "variants").mkdir(parents=True, exist_ok=True)
    (out / "variants" / cuda.VARIANT_CONSTANTS).write_text(json.dumps(constants, indent=1))
    (out / "variants" / cuda.TEMPLATE_VARIANTS).write_text(json.dumps(diffs, indent=1))
    libs = cuda.build(sources, out, flags, arch)
    from patchkit.carry import mlx_build

    version = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    short = pin.load(ROOT / pin.PIN_FILE).short
    meta = {"arch": arch, "nvcc": version.strip().splitlines()[-1],
            "build_inputs_sha256": mlx_build.build_inputs_id(ROOT, short, "cuda")}  # fmt: skip
    (out / BUILD_META).write_text(json.dumps(meta, indent=1) + "\n")
    print("\n".join(str(p) for p in libs.values()))


def build_meta(libs: Path) -> dict[str, Any] | None:
    """What ``build`` recorded of ``libs`` (arch, nvcc, build inputs); ``None`` for
    libraries it did not make."""
    path = libs / BUILD_META
    return json.loads(path.read_text()) if path.is_file() else None


def resources(libs: Path, out: Path, cuobjdump: str) -> None:
    """The static resources page of ``libs``'s patched library and its variants:
    ``out``.json and .md."""
    if (meta := build_meta(libs)) is None:
        raise SystemExit(f"no {libs / BUILD_META}: build the libraries with this checkout's "
                         "build first")  # fmt: skip
    paths = {cuda.SHIPPED: libs / "patched.so"}
    paths.update((p.stem, p) for p in sorted((libs / "variants").glob("*.so")))
    found = {
        n: cuda_resources.parse(cuda_resources.res_usage(p, cuobjdump)) for n, p in paths.items()
    }
    if empty := [str(paths[n]) for n, got in found.items() if not got]:
        raise SystemExit(f"no qmv_mma_kernel instance in {', '.join(empty)}")
    constants = json.loads((libs / "variants" / cuda.VARIANT_CONSTANTS).read_text())
    command = "python3 bench/cuda_qmv.py resources --libs LIBS --out " + str(out)
    data = cuda_resources.record(found, {**meta, "command": command, "constants": constants})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(cuda_resources.page(data))


def sass(
    libs: Path, mode: str | None, dtype: str | None, tools: tuple[str, str]
) -> dict[str, list[cuda_sass.LoopCount]]:
    """Main-loop instructions per step of K of the patched library and each variant, for
    the instances of ``mode`` and ``dtype`` (all when None); a library without one is a
    one-line exit. ``tools``: the cuobjdump and nvdisasm to run."""
    paths = {cuda.SHIPPED: libs / "patched.so"}
    paths.update((p.stem, p) for p in sorted((libs / "variants").glob("*.so")))
    if missing := [str(p) for p in paths.values() if not p.is_file()]:
        raise SystemExit(f"no {', '.join(missing)}: run `bench/cuda_qmv.py build` first")
    found = {}
    for name, path in paths.items():
        counts = [c for c in cuda_sass.count(cuda_sass.disassemble(path, *tools))
                  if mode in (None, c.mode) and dtype in (None, c.dtype)]  # fmt: skip
        if not counts:
            raise SystemExit(f"{path}: no qmv_mma_kernel instance of {mode or 'any mode'}")
        found[name] = counts
    return found


def shapes_arg(text: str) -> tuple[tuple[int, int], ...]:
    """``--shapes 8192x16896,8192x28672``: (K, N) pairs; K a multiple of 128 (one group
    of every size and a 4-bit step) and N of 16 (an MMA tile), else a one-line error."""
    shapes = []
    for item in text.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)", item.strip())
        k, n = (int(m[1]), int(m[2])) if m else (0, 0)
        if not k or not n or k % 128 or n % 16:
            raise argparse.ArgumentTypeError(
                f"{item!r}: give KxN with K a positive multiple of 128 and N of 16"
            )
        shapes.append((k, n))
    return tuple(shapes)


def compare_summary(
    paths: list[Path], against: str, min_n: int, by_layer: str | None, ms: str,
    pick: str | None = None,
) -> str:  # fmt: skip
    """``compare-summary``: the compare runs in ``paths`` (each a ``compare`` JSON or a
    page's JSON holding them as ``runs``), those of indices ``pick`` (``0,1``) if given,
    summarised by :func:`cuda.compare_summary`; a bad file, index or arm is a one-line
    exit."""
    runs = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"compare-summary: cannot read {path}: {exc}") from None
        found = data.get("runs", [data]) if isinstance(data, dict) else []
        if not found or not all(isinstance(r, dict) and "results" in r for r in found):
            raise SystemExit(f"compare-summary: {path} holds no compare run")
        runs += found
    for flag, text in (("--ms", ms), ("--runs", pick)):
        if text is not None and not re.fullmatch(r"\d+(,\d+)*", text):
            raise SystemExit(f"compare-summary: {flag} {text!r}: give numbers such as 0,1")
    if pick is not None:
        indices = [int(i) for i in pick.split(",")]
        if max(indices) >= len(runs):
            raise SystemExit(f"compare-summary: --runs {pick}: the files hold {len(runs)} runs")
        runs = [runs[i] for i in indices]
    try:
        return cuda.compare_summary(runs, against, min_n, by_layer, [int(m) for m in ms.split(",")])
    except ValueError as exc:
        raise SystemExit(f"compare-summary: {exc}") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, default=Path(".device/qmv"))
    b.add_argument("--arch", default="90a")
    b.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar=f"NAME={CONSTANTS_HELP}",
        help="also the patched file with launch constants "
        + ", ".join(cuda.LAUNCH_CONSTANTS)
        + " (given six, wide layers take the same tiles and stages)",
    )
    b.add_argument(
        "--template-variant",
        action="append",
        default=[],
        metavar="NAME=DIFF[:CONSTANTS]",
        help="also the patched file rendered from the templates with DIFF (git diff) applied "
        "(and these launch constants)",
    )
    r = sub.add_parser("run")
    r.add_argument("--libs", type=Path, default=Path(".device/qmv"))
    r.add_argument("--json", type=Path, required=True)
    r.add_argument("--deadline", type=float, default=480.0, help="seconds from start")
    r.add_argument("--quick", action="store_true", help="two layers only")
    r.add_argument("--bits", type=int, nargs="*", default=[4, 8])
    r.add_argument("--dtypes", nargs="*", default=["bfloat16"], choices=list(cuda.DTYPES))
    r.add_argument("--groups", type=int, nargs="*", default=[64], choices=cuda.GROUPS)
    rep = sub.add_parser("report")
    rep.add_argument("results", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("--libs", type=Path, default=Path(".device/qmv"))
    c.add_argument("--json", type=Path, required=True)
    c.add_argument("--deadline", type=float, default=480.0, help="seconds from start")
    c.add_argument("--group-size", type=int, default=64, choices=cuda.GROUPS)
    c.add_argument("--shapes", type=shapes_arg, default=cuda.COMPARE_SHAPES,
                   help="layers as KxN,KxN (default: the six of every compare page)")  # fmt: skip
    crep = sub.add_parser("compare-report")
    crep.add_argument("results", type=Path)
    csum = sub.add_parser("compare-summary", help="ratios over several compare runs")
    csum.add_argument("results", type=Path, nargs="+", help="compare JSON, or a page's {runs}")
    csum.add_argument("--against", default=cuda.SHIPPED, help="the arm ratios are over")
    csum.add_argument("--min-n", type=int, default=0, help="only layers of N >= this")
    csum.add_argument("--by-layer", metavar="ARM", help="also ARM's ratio per layer")
    csum.add_argument("--ms", default="1,8,16", help="the M of --by-layer's columns")
    csum.add_argument("--runs", help="only these runs, by index in the files' order: 0,1")
    res = sub.add_parser("resources", help="registers, spills, shared memory (cuobjdump)")
    res.add_argument("--libs", type=Path, default=Path(".device/qmv"))
    res.add_argument("--out", type=Path, required=True,
                     help="e.g. docs/results/cuda-kernel-resources")  # fmt: skip
    res.add_argument("--cuobjdump", default=os.environ.get("CUOBJDUMP", "cuobjdump"))
    sa = sub.add_parser("sass", help="main-loop instructions per step (nvdisasm)")
    sa.add_argument("--libs", type=Path, default=Path(".device/qmv"))
    sa.add_argument("--mode", choices=["affine 4-bit", "affine 8-bit", "nvfp4", "mxfp4", "mxfp8"])
    sa.add_argument("--dtype", choices=list(cuda.DTYPES))
    sa.add_argument("--json", type=Path, help="also the counts as JSON")
    sa.add_argument("--cuobjdump", default=os.environ.get("CUOBJDUMP", "cuobjdump"))
    sa.add_argument("--nvdisasm", default=os.environ.get("NVDISASM", "nvdisasm"))
    prof = sub.add_parser("profile", help="two calls of one library, for ncu -k regex:qmv")
    prof.add_argument("--lib", type=Path, default=Path(".device/qmv/patched.so"))
    prof.add_argument("--K", type=int, required=True)
    prof.add_argument("--N", type=int, required=True)
    prof.add_argument("--bits", type=int, default=4, choices=[4, 8])
    prof.add_argument("--m", type=int, default=1)
    prof.add_argument("--dtype", default="bfloat16", choices=list(cuda.DTYPES))
    prof.add_argument("--group", type=int, default=64, choices=cuda.GROUPS)
    args = ap.parse_args()
    if args.cmd == "profile":
        cfg = cuda.Config(args.K, args.N, args.bits, args.group, args.dtype)
        cuda.profile_call(args.lib, cfg, args.m)
        return 0
    if args.cmd == "sass":
        found = sass(args.libs, args.mode, args.dtype, (args.cuobjdump, args.nvdisasm))
        if args.json:
            rows = {n: [asdict(c) for c in counts] for n, counts in found.items()}
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
        print(cuda_sass.table(found), end="")
        return 0
    if args.cmd == "resources":
        resources(args.libs, args.out, args.cuobjdump)
        return 0
    if args.cmd == "build":
        build(args.out, args.arch, args.variant, args.template_variant)
        return 0
    if args.cmd == "report":
        print(cuda.report(json.loads(args.results.read_text())), end="")
        return 0
    if args.cmd == "compare-report":
        print(cuda.compare_report(json.loads(args.results.read_text())), end="")
        return 0
    if args.cmd == "compare-summary":
        print(compare_summary(args.results, args.against, args.min_n, args.by_layer, args.ms,
                              args.runs), end="")  # fmt: skip
        return 0
    if args.cmd == "compare":
        deadline = time.time() + args.deadline
        payload = cuda.compare(args.libs, args.json, deadline, args.group_size, args.shapes)
        bad = sum(
            p["differing"] + p["odd_neighbours_differing"]
            for r in payload["results"]
            for p in r["parity"].values()
        ) + sum(a["differing"] for r in payload["results"] for a in r["across"].values())
        blind = any(not c["differing"] for r in payload["results"] for c in r["control"].values())
        return 1 if bad or blind else 0
    shapes = cuda.SHAPES[:: len(cuda.SHAPES) - 1] if args.quick else cuda.SHAPES
    configs = [
        cuda.Config(K, N, bits, g, dt)
        for dt in args.dtypes
        for g in args.groups
        for bits in args.bits
        for K, N in shapes
    ]
    payload = cuda.run(
        args.libs, configs, args.json, time.time() + args.deadline, build_meta(args.libs)
    )
    bad = sum(
        r["parity"]["differing"] + r["parity"]["odd_neighbours_differing"]
        for r in payload["results"]
    )
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
