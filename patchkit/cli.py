"""The ``patchkit`` command line: thin subcommands over the library's public functions.

Only this module prints and exits. Each subcommand is one function that parses
its options, calls one library function and reports the result (a rich line for
people, ``--json`` for machines). Errors are mapped to messages and exit codes
once, in :class:`_Main`. To add a subcommand, write one more decorated function
using :func:`common_options`; nothing else needs to change.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from patchkit import restore_interrupt
from patchkit.carry import apply as apply_mod
from patchkit.carry import check as check_mod
from patchkit.carry import clean as clean_mod
from patchkit.carry import rebase as rebase_mod
from patchkit.carry import render, transaction
from patchkit.errors import PatchkitError, ToolError, UserError
from patchkit.util.cache import root as cache_root
from patchkit.verify.dispatch import FP_MODES, MODES

EXIT_FAIL = 1  # a check that ran and found problems, or a user-fixable error
EXIT_TOOL = 3  # an external tool failed unexpectedly
EXIT_PENDING = 4  # check: current but for a killed write the next apply finishes or undoes

err_console = Console(stderr=True, soft_wrap=True)  # one error, one line, at any width
out_console = Console(soft_wrap=True)  # results on stdout, unwrapped so they can be piped


class _Main(click.Group):
    """Click group that turns patchkit errors into one clear line and an exit code."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # Known before any parsing can fail, so a usage error can answer in JSON.
        ctx.meta["json"] = "--json" in args
        if len(args) > 1 and args[0] == "--json":  # `patchkit --json status`: the command's flag
            args = [args[1], *args[2:], "--json"]
        restore_interrupt()  # from here on, invoke() answers Ctrl-C
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except PatchkitError as exc:
            code = EXIT_TOOL if isinstance(exc, ToolError) else EXIT_FAIL
            self._fail(ctx, exc, str(exc), code, exc.details)
            rest = str(exc).split("\n", 1)[1:] if isinstance(exc, ToolError) else []
            if rest:  # the tool's own output, after the one line (not repeating it)
                err_console.print(rest[0], highlight=False, markup=False)
            if exc.details:  # an upstream diff, say: after the line, for reading
                err_console.print(exc.details.rstrip("\n"), highlight=False, markup=False)
            ctx.exit(code)
        except KeyboardInterrupt as exc:
            self._fail(ctx, exc, "interrupted; a later run finishes or undoes its writes", 130)
            ctx.exit(130)
        except click.UsageError as exc:
            if not _wants_json(ctx):
                raise
            self._fail(ctx, exc, exc.format_message(), exc.exit_code)
            ctx.exit(exc.exit_code)
        except OSError as exc:  # a path patchkit was pointed at is not usable
            where = f": {exc.filename}" if exc.filename else ""
            message = f"{exc.strerror or exc}{where}; check the path and its permissions"
            self._fail(ctx, exc, message, EXIT_FAIL)
            ctx.exit(EXIT_FAIL)
        except Exception as exc:  # a bug: JSON still answers, and the traceback follows
            if _wants_json(ctx):
                self._fail(ctx, exc, f"internal error: {exc!r}", EXIT_FAIL)
            raise

    @staticmethod
    def _fail(
        ctx: click.Context, exc: BaseException, message: str, code: int, details: str = ""
    ) -> None:
        """One line on stderr; under --json also one JSON object on stdout."""
        first = message.splitlines()[0] if message else type(exc).__name__
        if _wants_json(ctx):
            kind = type(exc).__name__
            payload = {"ok": False, "error": message, "kind": kind, "exit": code}
            click.echo(json.dumps(payload | ({"details": details} if details else {})))
        err_console.print(f"[bold red]patchkit: error:[/] {escape(first)}", highlight=False)


def _wants_json(ctx: click.Context) -> bool:
    """--json was asked for (seen by :meth:`_Main.parse_args`, so also on usage errors)."""
    return bool(ctx.meta.get("json"))


def find_root(start: Path) -> Path:
    """The patchkit checkout containing ``start``: the first ancestor with ``templates/``."""
    for d in (start, *start.parents):
        if (d / "templates").is_dir() and (d / "pyproject.toml").is_file():
            return d
    raise UserError(f"no patchkit checkout at or above {start}; cd into it or pass --root")


@contextmanager
def progress(as_json: bool) -> Iterator[Callable[[str], None]]:
    """A progress callback on stderr: a live spinner on a terminal, else one line per step.

    Under --json too (stdout carries only the JSON), so a long run never looks hung.
    """
    if as_json or not err_console.is_terminal:
        yield lambda msg: err_console.print(f"[dim]{escape(msg)}…[/]", highlight=False)
        return
    with err_console.status("starting") as st:
        yield lambda msg: st.update(f"{escape(msg)}…")


_NO_WAIT = click.option(
    "--no-wait",
    "no_wait",
    is_flag=True,
    help="Refuse at once, instead of waiting, while another patchkit run writes here.",
)


def common_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Options every tree-touching subcommand shares; resolves them into keyword arguments."""

    @click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
    @click.option(
        "--mlx-repo",
        metavar="PATH_OR_URL",
        help="MLX source to clone from (default: env PATCHKIT_MLX_REPO, else pin.toml's URL).",
    )
    @click.option(
        "--root", type=click.Path(file_okay=False, path_type=Path), help="patchkit checkout."
    )
    @click.option(
        "--templates",
        type=click.Path(file_okay=False, path_type=Path),
        help="Templates folder (default: the checkout's templates/).",
    )
    @click.option(
        "--backend",
        "backends",
        multiple=True,
        type=click.Choice(render.BACKENDS),
        help="Backends to render (repeatable; default all).",
    )
    @wraps(fn)
    def wrapper(as_json: bool, mlx_repo, root, templates, backends, **kw: Any) -> Any:
        click.get_current_context().meta["json"] = as_json
        if root is not None and not root.is_dir():
            raise UserError(f"--root {root}: no such folder; pass your patchkit checkout")
        root = (root or find_root(Path.cwd())).resolve()
        common = {
            "root": root,
            "mlx_repo": mlx_repo,
            "templates_dir": templates or root / "templates",
            "options": render.RenderOptions(tuple(backends) or render.BACKENDS),
        }
        return fn(as_json=as_json, common=common, **kw)

    return wrapper


def emit(as_json: bool, payload: dict[str, Any], human: str) -> None:
    """Print the result once, in the requested form."""
    if as_json:
        click.echo(json.dumps(payload, indent=2, sort_keys=True))
    else:
        out_console.print(human, highlight=False, markup=False)


@click.group(cls=_Main)
@click.version_option(package_name="patchkit")
def main() -> None:
    """Carry MLX's order-preserving batched qmv change over a pinned MLX commit."""


@main.command("apply")
@click.option(
    "--pin",
    "rev",
    metavar="REV",
    help="Check that pin.toml pins REV (default: apply what pin.toml pins; needed without one).",
)
@click.option("--release", help="Release whose touched files are byte-identical (pin.toml).")
@_NO_WAIT
@common_options
def apply_cmd(
    rev: str | None, release: str | None, no_wait: bool, as_json: bool, common: dict[str, Any]
) -> None:
    """Render, commit on patchkit/<short> and export patches/<short>/."""
    with progress(as_json) as say:
        r = apply_mod.apply(rev, release=release, progress=say, wait=not no_wait, **common)
    if r.removed:
        err_console.print(
            f"[yellow]warning:[/] removed {len(r.removed)} file(s) apply does not produce "
            f"from {r.patches_dir}: {', '.join(r.removed)}",
            highlight=False,
        )
    what = "updated" if (r.patches_changed or r.pin_changed) else "unchanged (no-op)"
    emit(
        as_json,
        r.to_json(),
        f"applied {r.upstream[:8]} -> {r.branch} ({r.head[:8]}) in {r.clone}\n"
        f"{r.patches_dir} {what}",
    )


@main.command("rebase")
@click.option("--to", "rev", required=True, metavar="REV", help="Upstream commit to move to.")
@click.option(
    "--release",
    help="Release twin of the new pin (default: the old twin while the touched files match).",
)
@click.option(
    "--allow-downgrade", is_flag=True, help="Accept a REV that does not descend from the pin."
)
@click.option(
    "--accept-routing-change",
    "accept_routing",
    is_flag=True,
    help="Go on although upstream changed a routing function (after reading the diff the"
    " refusal showed); parity still runs.",
)
@_NO_WAIT
@common_options
def rebase_cmd(
    rev: str,
    release: str | None,
    allow_downgrade: bool,
    accept_routing: bool,
    no_wait: bool,
    as_json: bool,
    common: dict[str, Any],
) -> None:
    """Move the pin to REV, gated on dependency and routing changes and CPU parity."""
    from patchkit.verify import rebase_gate

    with progress(as_json) as say:
        r = rebase_mod.rebase(
            rev,
            parity_check=functools.partial(rebase_gate.emulator_parity, say=say),
            fp_parity_check=functools.partial(rebase_gate.emulator_fp_parity, say=say),
            release=release,
            allow_downgrade=allow_downgrade,
            accept_routing=accept_routing,
            progress=say,
            wait=not no_wait,
            **common,
        )
    emit(as_json, r.to_json(), r.summary())


@main.command("check")
@common_options
def check_cmd(as_json: bool, common: dict[str, Any]) -> None:
    """Fail when patches/ or pin.toml differ from what apply would produce now."""
    with progress(as_json) as say, transaction.reading(common["root"], say):
        r = check_mod.check(progress=say, **common)
    lines = "\n".join(r.problems()) or f"patches/{r.commit[:8]} is current"
    if r.only_interrupted:  # not stale: a killed write the next apply finishes or undoes
        emit(as_json, r.to_json(), lines)
        sys.exit(EXIT_PENDING)
    if not r.ok:
        lines += "\nrun `patchkit apply` and commit patches/ and pin.toml"
    emit(as_json, r.to_json(), lines)
    if not r.ok:
        sys.exit(EXIT_FAIL)


@main.command("status")
@common_options
def status_cmd(as_json: bool, common: dict[str, Any]) -> None:
    """What is pinned, where it is applied, and whether patches/ is current."""
    with progress(as_json) as say, transaction.reading(common["root"], say):
        s = check_mod.status(progress=say, **common)
    current = "current" if s["patches_current"] else "STALE: " + "; ".join(s["problems"])
    if s["interrupted"] and len(s["problems"]) == 1:  # a killed write, nothing stale
        current = "PENDING: " + s["problems"][0]
    if not s["patches_current"] and not s["interrupted"]:
        current += " (run `patchkit apply` and commit patches/)"
    emit(
        as_json,
        s,
        f"pinned {s['upstream_commit']} of {s['upstream_url']} "
        f"({s['release'] or 'no release twin'}); moved by rebase {s['bumps']} time(s) "
        "(pin.toml's [[history]])\n"
        f"applied on {s['branch']} = {s['branch_head']} in {s['clone']}\n"
        f"{s['patches_dir']}: {current}",
    )


@main.command("install")
@click.option(
    "--into",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    metavar="VENV",
    required=True,
    help="The virtual environment to install into.",
)
@click.option("--backend", type=click.Choice(["metal", "cuda", "cpu"]), help="As for build.")
@click.option("--cmake-arg", "cmake_args", multiple=True, help="As for build (its folder).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def install_cmd(
    into: Path, backend: str | None, cmake_args: tuple[str, ...], as_json: bool
) -> None:
    """Put the wheel `patchkit build` made into VENV, as `build --into` does: checked first
    (Python, stock split packages, an engine needing another release), then kept there."""
    from patchkit.carry import mlx_build

    root = find_root(Path.cwd())
    plan = mlx_build.plan(root, backend=backend, cmake_args=cmake_args)
    wheel = plan.wheel()
    if wheel is None:
        raise UserError(f"no wheel of mlx {plan.version} in {plan.layout.dist}; run "
                        f"`patchkit build --backend {plan.backend}` first")  # fmt: skip
    mlx_build.check_into(into, plan.python, plan.version)
    done = mlx_build.install_into(wheel, into, plan.python, plan.version)
    emit(as_json, {"wheel": str(wheel), **done},
         f"installed into {into}: mlx {done['mlx_version']}\n{done['kept']}\n"
         f"back to stock MLX there: {done['release']}")  # fmt: skip


@main.command("clean")
@click.argument("folders", nargs=-1, type=click.Choice([*clean_mod.DEFAULT, *clean_mod.NAMED_ONLY]))
@click.option("--yes", is_flag=True, help="Free them (default: only show what each holds).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def clean_cmd(folders: tuple[str, ...], yes: bool, as_json: bool) -> None:
    """Show patchkit's cache, folder by folder; with --yes free FOLDERS (default: builds,
    emulate, wheels, tools). Never touches a checkout or a venv; skips what a run holds."""
    if not yes:
        rows = clean_mod.usage()
        human = "\n".join(
            f"{r['folder']:8} {r['bytes'] / 2**20:9.1f} MiB  {r['what']}"
            + ("" if r["freed_by_default"] else "  [only when named]")
            for r in rows
        )
        hint = "free with: patchkit clean --yes [FOLDER...]"
        emit(as_json, {"root": str(cache_root()), "folders": rows},
             f"{cache_root()}\n{human}\n{hint}")  # fmt: skip
        return
    done = clean_mod.free(folders or clean_mod.DEFAULT)  # type: ignore[arg-type]
    lines = [f"removed {p}" for p in done["removed"]]
    lines += [f"in use by a running patchkit, kept: {p}" for p in done["in_use"]]
    emit(as_json, done, "\n".join(lines) or "nothing to remove")


@main.command("mac-report")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for the steps' logs and the report (default: in patchkit's cache).",
)
@click.option("--no-jit", is_flag=True, help="Skip the MLX_METAL_JIT=ON build.")
@click.option("--dry-run", is_flag=True, help="Print the plan (on any machine); run nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def mac_report_cmd(out: Path | None, no_jit: bool, dry_run: bool, as_json: bool) -> None:
    """On a Mac: the Metal PR's tests on main and on the branch (AOT and JIT), parity and the
    PR's benchmark on the GPU, metallib size and kernel compile time, as one report."""
    import platform

    from patchkit.carry import mac_report

    root = find_root(Path.cwd())
    where = mac_report.paths(root, out.resolve() if out else None)
    out = where.out
    steps = mac_report.plan(root, where, jit=not no_jit)
    if dry_run:
        emit(as_json, {"dry_run": True, "steps": [{"stage": s.stage, "why": s.why,
                                                  "command": s.shell()} for s in steps]},
             "\n".join(f"# [{s.stage}] {s.why}\n{s.shell()}" for s in steps))  # fmt: skip
        return
    if platform.system() != "Darwin" or platform.machine() != "arm64":
        raise UserError("mac-report runs on a Mac with Apple silicon (and Xcode);"
                        " `patchkit mac-report --dry-run` prints its plan anywhere")  # fmt: skip
    if out.exists() and any(out.iterdir()) and not (out / "steps.json").is_file():
        raise UserError(f"--out {out} holds files that are not a mac-report's; choose another")
    with progress(as_json) as say:
        mac_report.run(steps, out, say)
    data, text = mac_report.report(where)
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str))
    (out / "report.md").write_text(text)
    emit(as_json, data, text + f"\nreport: {out / 'report.md'}")


@main.command("emulate")
@click.option(
    "--kernel",
    type=click.Choice(["streamed", "wide"]),
    help="Check one case with this batched kernel (needs -K -N -M ...); default: the matrix.",
)
@click.option("-K", "K", type=int, help="Input size (columns of the weight matrix).")
@click.option("-N", "N", type=int, help="Output size (rows of the weight matrix).")
@click.option("-M", "M", type=int, default=6, show_default=True, help="Vectors in the batch.")
@click.option("-B", "B", type=int, default=1, show_default=True, help="Batch count.")
@click.option("--bits", type=int, default=4, show_default=True, help="Affine bits.")
@click.option("--group-size", type=int, default=64, show_default=True, help="Affine group size.")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float16")
@click.option(
    "--mode",
    type=click.Choice(["all", "affine", "fp", *FP_MODES]),
    default="all",
    show_default=True,
    help="Mode(s) the matrix runs (fp: the three fp modes); --kernel takes one (all: affine).",
)
@click.option(
    "--global-scale", is_flag=True, help="With --kernel and --mode nvfp4: the _hgs variant."
)
@click.option("--narrow", is_flag=True, help="With --kernel and --mode nvfp4: the r_2 fast tile.")
@click.option(
    "--toolchain",
    type=click.Choice(["gcc", "clang", "gcc-fast", "clang-fast", "both", "all"]),
    default="gcc",
    show_default=True,
    help="g++ -ffp-contract=off, clang -ffp-contract=on -mfma, g++/clang -O2 "
    "-ffp-contract=fast -mfma (cross-statement fusion), both (gcc, clang) or all four "
    "(about 3x the default's time; their verdicts answer a later rebase's gate).",
)
@click.option(
    "--full",
    is_flag=True,
    help="Run the full matrix (~8,400 affine, ~2,900 fp cases) instead of the default subset.",
)
@click.option(
    "--header",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The pin's upstream quantized.h (default: the release-twin wheel's); hash-checked.",
)
@click.option(
    "--fp-header",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The pin's fp_quantized.h, with fp4.h/fp8.h beside it (default: the wheel's).",
)
@click.option(
    "--costs",
    is_flag=True,
    help="Instead: what clang's optimized IR makes of each patched kernel at V = 1, 2, 5 "
    "(thread arrays, weight loads, live words; a proxy for Apple's compiler).",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def emulate_cmd(
    kernel: str | None, as_json: bool, header: Path | None, costs: bool, **opts: Any
) -> None:
    """Prove the Metal change on the CPU: M = 1 kernels unchanged, batched rows = M = 1.

    First every M = 1 kernel instance, compiled from upstream's and the patched
    text, must give the same optimized IR; then the patched kernels at
    vecs_per_tg > 1 run under a Metal shim and every row (and every simd_sum's
    32 inputs) must equal upstream's M = 1 kernel bit for bit, while upstream's
    qmv_wide, the negative control, differs. About 2 minutes on 2 cores.
    """
    from patchkit.verify.emulate import cli_support

    ctx = click.get_current_context()
    ctx.meta["json"] = as_json
    given = [
        name
        for name in ("K", "N", "M", "B", "bits", "group_size", "dtype", "global_scale", "narrow")
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
    ]
    if given and not kernel:
        flags = ", ".join(("-" if len(n) == 1 else "--") + n.replace("_", "-") for n in given)
        raise UserError(f"{flags} describe one case: add --kernel streamed|wide, or drop them")
    if kernel and opts["M"] < 2:
        raise UserError("-M must be at least 2: the check compares M rows with M = 1")
    root = find_root(Path.cwd())
    if costs:
        if kernel or given:
            raise UserError("--costs reads every patched kernel: drop --kernel and its case")
        from patchkit.verify.emulate import costs as ir_costs

        with progress(as_json) as say:
            say("compiling every patched kernel at V = 1, 2, 5 to optimized IR (clang)")
            report = {"command": "patchkit emulate --costs", **ir_costs.collect(root)}
        emit(as_json, report, ir_costs.page(report))
        return
    with progress(as_json) as say:
        if kernel:
            payload, human, ok = cli_support.one_case(root, header, kernel, opts, say)
        else:
            payload, human, ok = cli_support.matrix(root, header, opts, say)
    emit(as_json, payload, human)
    if not ok:
        sys.exit(EXIT_FAIL)


@main.command("parity")
@click.option("--quick/--full", default=True, help="The default subset, or every axis.")
@click.option("--mode", "modes", multiple=True, type=click.Choice(MODES))
@click.option("--bits", "bits", multiple=True, type=int, help="Only these bits (repeatable).")
@click.option(
    "--dtype", "dtypes", multiple=True, type=click.Choice(["float32", "float16", "bfloat16"])
)
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), help="Also write JSON here."
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
def parity_cmd(quick: bool, modes, bits, dtypes, out: Path | None, as_json: bool) -> None:
    """Compare batched rows of the importable MLX with M = 1, bit for bit (exit 1 if any differ)."""
    from patchkit.verify import mlx_parity

    click.get_current_context().meta["json"] = as_json
    with progress(as_json) as say:
        report = mlx_parity.run(mlx_parity.configs(not quick, modes, bits, dtypes), progress=say)
    if out:
        mlx_parity.write_json(out, report)
    emit(as_json, report, mlx_parity.format_report(report))
    code = 0 if report["identical"] else EXIT_FAIL
    if report["device"]["backend"] == "cuda":  # the verdict is out: no teardown to abort it
        mlx_parity.exit_without_teardown(code)
    if code:
        sys.exit(code)


@main.command("export-pr")
@click.option(
    "--backend",
    type=click.Choice(render.BACKENDS),
    default="metal",
    show_default=True,
    help="Which PR: the JIT fix, the qmm_sm90 fix (both first), Metal (builds on the "
    "JIT fix), CUDA.",
)
@click.option(
    "--onto",
    metavar="REV",
    help="Commit or branch to build on (default: MLX's main, the clone's newest; "
    "give pin.toml's commit for the pin, or an earlier PR's branch to stack).",
)
@click.option(
    "--stacked",
    is_flag=True,
    help="--onto already holds the PRs this one builds on (the Metal PR: the JIT fix); "
    "without it, a missing one is carried as a first commit.",
)
@click.option(
    "--branch",
    help="Branch name (default, by backend: "
    + ", ".join(f"{backend} {branch}" for backend, branch in render.DEFAULT_BRANCHES.items())
    + ").",
)
@click.option("--force", is_flag=True, help="Move the branch if it exists already.")
@click.option("--title", help="Commit subject (default: the backend's, from templates/pr/).")
@click.option("--push", metavar="URL_OR_PATH", help="Push the branch there (never by default).")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="A new or empty folder for the patch and the body (default: a fresh build/pr/...).",
)
@click.option(
    "--author",
    metavar="'NAME <EMAIL>'",
    help="Commit author (default: your git user.name/user.email).",
)
@click.option(
    "--install-formatters",
    is_flag=True,
    help="Install upstream's formatter pins into patchkit's own tool venv (not yours).",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
@click.option("--mlx-repo", metavar="PATH_OR_URL", help="MLX source to clone from.")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), help="patchkit checkout.")
@click.option("--templates", type=click.Path(file_okay=False, path_type=Path), help="Templates.")
def export_pr_cmd(as_json: bool, root: Path | None, templates: Path | None, **kw: Any) -> None:
    """One upstream-ready PR branch (its commits, patches and body) on MLX's main or a branch."""
    from patchkit.carry import export_pr

    click.get_current_context().meta["json"] = as_json
    root = (root or find_root(Path.cwd())).resolve()
    kw["out_dir"] = kw.pop("out")
    with progress(as_json) as say:
        r = export_pr.export_pr(
            root=root, templates_dir=templates or root / "templates", progress=say, **kw
        )
    for line in r.warnings:
        err_console.print(f"[yellow]warning:[/] {escape(line)}", highlight=False)
    emit(
        as_json,
        r.to_json(),
        f"{r.backend}: branch {r.branch} = {r.commit[:8]} on {r.base[:8]} in {r.repository}"
        + (f" (first: {', '.join(r.changes[:-1])})" if len(r.changes) > 1 else "")
        + "\npatches (apply in order with git am): "
        + " ".join(str(p) for p in r.patches)
        + "\n"
        f"PR body: {r.body}\n  {export_pr.DRAFT_NOTICE}",
    )


_DEPS_OPTION = click.option(
    "--deps",
    "deps_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Dependency directory (default: the cache's deps folder).",
)


@main.command("vendor")
@click.argument("checkout", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option(
    "--flavour",
    type=click.Choice(["series", "overlay"]),
    default="series",
    show_default=True,
    help="series: git am the commits; overlay: copy the touched files whole (uncommitted).",
)
@click.option("--dry-run", is_flag=True, help="Check the checkout and list the changes only.")
@_NO_WAIT
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def vendor_cmd(checkout: Path, flavour: str, dry_run: bool, no_wait: bool, as_json: bool) -> None:
    """Put patches/<pin>/ into your own MLX checkout (at the pin, clean)."""
    from patchkit.carry import vendor

    click.get_current_context().meta["json"] = as_json
    with progress(as_json) as say:
        r = vendor.vendor(
            find_root(Path.cwd()),
            checkout,
            flavour,
            dry_run=dry_run,
            wait=not no_wait,
            progress=say,
        )
    verb = "would apply" if dry_run else "applied"
    what = "commits from" if flavour == "series" else "whole files from"
    emit(
        as_json,
        r.to_json(),
        f"{verb} {len(r.files)} {what} patches/ to {r.checkout} ({flavour}); HEAD {r.head[:8]}\n"
        + "\n".join(f"  {f}" for f in r.files),
    )


@main.command("build")
@click.option(
    "--backend",
    type=click.Choice(["metal", "cuda", "cpu"]),
    help="Default: metal on macOS, cuda where nvidia-smi lists a GPU, else cpu.",
)
@click.option("--mlx-repo", metavar="PATH_OR_URL", help="Clone the branch lives in (as apply).")
@click.option(
    "--offline",
    is_flag=True,
    help="Take MLX's dependencies from the dependency directory (`patchkit deps`), not the "
    "network; implied by --deps.",
)
@_DEPS_OPTION
@click.option("--jobs", "-j", type=click.IntRange(min=1), help="Parallel compile jobs.")
@click.option("--cmake-arg", "cmake_args", multiple=True, help="Extra CMake argument (repeat).")
@click.option(
    "--system-site-packages",
    is_flag=True,
    help="Let patchkit's venv see this Python's packages and PYTHONPATH's folders (an offline "
    "host without MLX).",
)
@click.option(
    "--into",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    metavar="VENV",
    help="Also pip-install the patched wheel into this virtual environment (never otherwise).",
)
@click.option(
    "--record-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Write the build record here (default: the build's folder in patchkit's cache; "
    "docs/results refreshes the project's own records).",
)
@click.option(
    "--no-test",
    "run_tests",
    is_flag=True,
    flag_value=False,
    default=True,
    help="Skip MLX's test_quantized.py (parity still runs); the record says so.",
)
@click.option(
    "--test-timeout",
    type=click.IntRange(min=1),
    metavar="SECONDS",
    help="Stop MLX's tests after this long; the record names the methods left unfinished "
    "(on CUDA the whole file compiles MLX's qmm kernels for tens of minutes).",
)
@click.option("--dry-run", is_flag=True, help="Print the exact commands and env; run nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def build_cmd(
    dry_run: bool,
    as_json: bool,
    record_dir: Path | None,
    cmake_args: tuple[str, ...],
    into: Path | None,
    **kw: Any,
) -> None:
    """Build an MLX wheel from the patched tree in patchkit's own venv; run its tests, parity."""
    from patchkit.carry import mlx_build

    click.get_current_context().meta["json"] = as_json
    root = find_root(Path.cwd())
    plan = mlx_build.plan(root, cmake_args=cmake_args, **kw)
    if dry_run:
        shown = {**plan.to_json(), "dry_run": True}
        text = plan.describe()
        if into is not None:  # the last step --into adds, after the build's own
            shown["into"] = mlx_build.into_steps(into, plan.layout.dist, plan.version)
            text += "\n" + "\n".join(shown["into"])
        emit(as_json, shown, text)
        return
    if into is not None:  # refused now, not after the compile
        mlx_build.check_into(into, plan.python, plan.version)
    with progress(as_json) as say:
        rec = mlx_build.execute(plan, root, say)
        if into is not None and rec["wheel"]:
            say(f"installing {Path(rec['wheel']).name} into {into}")
            rec["installed_into"] = mlx_build.install_into(
                Path(rec["wheel"]), into, plan.python, plan.version
            )
    # The record names the wheel, not where this machine keeps it, nor the user's venv.
    kept = {k: v for k, v in rec.items() if k != "installed_into"}
    kept["wheel"] = Path(rec["wheel"]).name if rec["wheel"] else None
    path = mlx_build.write_record(kept, record_dir or plan.layout.base)
    t, p = rec["tests"], rec["parity"]
    wheel = Path(rec["wheel"]) if rec["wheel"] else None
    lines = [
        f"built MLX {rec['mlx_version']} ({rec['backend']}) in {plan.layout.worktree}",
        mlx_build.tests_line(t).removeprefix("- "),
        f"parity: {p['rows_differing']}/{p['rows']} rows differ "
        f"(paths {', '.join(p['kernel_paths'])})" + mlx_build.route_words(p.get("route_env")),
        *(
            [mlx_build.parity_default_line(rec["parity_default"]).removeprefix("- ")]
            if "parity_default" in rec
            else []
        ),
        *([f"LTO off: {rec['no_lto']}"] if rec.get("no_lto") else []),
        f"record: {path}",
        f"log: {plan.layout.log}",
    ]
    again = mlx_build.install_line(plan.backend, cmake_args)
    if wheel and "installed_into" not in rec:
        lines += [f"wheel: {wheel}", "install it into the venv you run MLX from (kept there):",
                  f"  {again}"]  # fmt: skip
    if "installed_into" in rec:
        done = rec["installed_into"]
        lines += [f"installed into {into}: mlx {done['mlx_version']}", done["kept"],
                  f"back to stock MLX there: {done['release']}"]  # fmt: skip
    emit(as_json, {**rec, "record": str(path), "log": str(plan.layout.log),
                   "install": again if wheel else None},
         "\n".join(lines))  # fmt: skip
    if t and (t["failed"] or t["errors"]):
        raise UserError(f"MLX's test_quantized.py failed on the build; log: {plan.layout.log}")
    if p["rows_differing"]:
        raise UserError(f"parity: rows differ on the build; see {plan.layout.parity_json}")
    if "parity_default" in rec and mlx_build.patch_rows_differing(rec["parity_default"]):
        raise UserError(
            "parity: rows differ on the patch's kernels on the default route; see "
            f"{plan.layout.parity_default_json}"
        )


@main.command("deps")
@click.option(
    "--from",
    "search",
    required=True,
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Folder of local git clones (owner+name/repo, owner/name.git or name/).",
)
@click.option(
    "--backend",
    "backends",
    multiple=True,
    type=click.Choice(["cpu", "cuda", "metal"]),
    help="Which backends' dependencies (repeat; default: the one `patchkit build` would pick).",
)
@click.option(
    "--rev",
    "revs",
    multiple=True,
    metavar="NAME=REV",
    help="Export REV instead of the pinned tag (a clone that lacks it); recorded in the stamp.",
)
@click.option("--mlx-repo", metavar="PATH_OR_URL", help="Clone the pin lives in (as apply).")
@_DEPS_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def deps_cmd(
    search: Path,
    backends: tuple[str, ...],
    revs: tuple[str, ...],
    mlx_repo: str | None,
    deps_dir: Path | None,
    as_json: bool,
) -> None:
    """Fill the dependency directory an offline `patchkit build` reads, from local clones."""
    from patchkit.carry import mlx_build, mlx_deps, pin, source

    click.get_current_context().meta["json"] = as_json
    root = find_root(Path.cwd())
    p = pin.load(root / pin.PIN_FILE)
    subs = dict(r.split("=", 1) for r in revs if "=" in r)
    if len(subs) != len(revs):
        raise UserError("--rev takes NAME=REV, e.g. --rev nvtx3=v3.1.0")
    backends = backends or (mlx_build.detect_backend(),)
    with progress(as_json) as say:
        clone = source.ensure_clone(source.source_spec(mlx_repo, p.url), progress=say)
        read = source.reader(clone, p.commit)
        deps = {d.name: d for b in backends for d in mlx_deps.declared(read, b)}
        target = deps_dir or mlx_deps.deps_root()
        filled = mlx_deps.fill(list(deps.values()), search, target, say, subs)
    emit(
        as_json,
        {"deps": str(target), "filled": filled, "declared": sorted(deps),
         "backends": list(backends)},
        f"{target}: {len(deps)} sources for {p.short}, {'/'.join(backends)} "
        f"({', '.join(sorted(deps))}); exported {', '.join(filled) or 'none (all current)'}",
    )  # fmt: skip


@main.command("bench")
@click.option("--quick/--full", default=True, help="One shape and a few M, or everything.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench.json"),
    show_default=True,
    help="JSON here; the .md table and .png plot beside it.",
)
@click.option(
    "--mode",
    type=click.Choice(MODES),
    default="affine",
    show_default=True,
    help="Quantization mode (the fp modes take fp_qmv_wide on every GPU generation).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
def bench_cmd(quick: bool, out: Path, mode: str, as_json: bool) -> None:
    """Time stock qmv, stock batched and the streamed JIT kernel on an Apple GPU."""
    from patchkit.verify import bench

    click.get_current_context().meta["json"] = as_json
    root = find_root(Path.cwd())
    with progress(as_json) as say:
        report = bench.run(root, quick, say, mode)
    written = bench.write(report, out)
    emit(as_json, report, bench.markdown(report) + "wrote " + ", ".join(map(str, written)))


def _probe_root() -> Path:
    """The checkout (the Metal arm renders its kernel from it); the probe runs without one."""
    try:
        return find_root(Path.cwd())
    except UserError:
        return Path.cwd()


@main.command("probe")
@click.option("--size", default="tiny", show_default=True, help="tiny (CPU), 1b or 3b shapes.")
@click.option("--bits", "bits", multiple=True, type=click.Choice(["4", "8"]), help="Default 4, 8.")
@click.option(
    "--arm",
    "arms",
    multiple=True,
    type=click.Choice(["stock", "streamed", "reordered"]),
    help="Quantized linear (repeatable; default stock + streamed; reordered = negative control).",
)
@click.option("--max-t", type=int, default=16, show_default=True, help="Verify T = 2 … max-t.")
@click.option("--prompt-len", type=int, default=32, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--per-op/--no-per-op", default=True, help="Per-op parity (isolates the op).")
@click.option(
    "--attention",
    type=click.Choice(["fused", "per_query"]),
    default="fused",
    show_default=True,
    help="Block attention: one causal sdpa call, or per query as the chain calls it.",
)
@click.option("--timing", is_flag=True, help="Time block vs chain; simulated speculative tok/s.")
@click.option(
    "--acceptance",
    type=float,
    default=0.7,
    show_default=True,
    help="Per-token probability a drafted token is accepted (for the simulated tok/s).",
)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="JSON (+ .md).")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON report on stdout.")
def probe_cmd(as_json: bool, out: Path | None, **kw: Any) -> None:
    """Verify block vs chain of single-token forwards on a quantized decoder, byte for byte."""
    from patchkit.verify.probe import Options, report
    from patchkit.verify.probe import run as probe_run

    click.get_current_context().meta["json"] = as_json
    max_t = kw.pop("max_t")
    if not 2 <= max_t <= 16:
        raise UserError("--max-t must lie in 2..16")
    opts = Options(
        size=kw["size"],
        bits=tuple(int(b) for b in kw["bits"]) or (4, 8),
        arms=tuple(kw["arms"]) or ("stock", "streamed"),
        ts=tuple(range(2, max_t + 1)),
        prompt_len=kw["prompt_len"],
        seed=kw["seed"],
        per_op=kw["per_op"],
        timing=kw["timing"],
        alpha=kw["acceptance"],
        root=_probe_root(),
        attention=kw["attention"],
    )
    with progress(as_json) as say:
        payload = probe_run(opts, say)
    if out:
        report.write(payload, out, "patchkit probe " + " ".join(sys.argv[2:]))
    emit(as_json, payload, report.human(payload))
