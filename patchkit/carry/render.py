"""Render the patch: templates + upstream text -> new upstream file texts.

Each upstream file the patch touches has a directory under ``templates/`` at
its upstream path (``templates/mlx/backend/metal/kernels/quantized.h/``)
holding ``edits.toml`` and Jinja snippets. ``edits.toml`` says where each
snippet goes, by structure (after a function, before a statement, inside a
macro), which upstream functions the rendered code mirrors or calls, and which
variants are derived mechanically from upstream text at render time. The
templates therefore hold only this project's code; upstream's own functions are
called by name or derived from the tree being patched, so a pin bump carries
upstream's change along.

Rendering is a pure function of (upstream texts, options): no git, no I/O
besides reading ``templates/``. That is what makes re-rendering for
``patchkit check`` byte-stable.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import jinja2

from patchkit.carry import cxx, hunks, pyedit
from patchkit.errors import AnchorError, UserError

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"
MANIFEST = "edits.toml"

Flavour = Literal["upstream", "overlay"]
Routing = Literal["stream", "opt_in"]
# Where the CUDA streamed qmv reads x from: a shared-memory copy staged once per
# block (the default, what patches/ holds), or straight from global memory, as the
# M = 1 kernel does (the measured baseline, and the register-only timing arm of
# scripts/cuda_bench_variants.py; see docs/cuda.md).
CudaXStaging = Literal["global", "smem"]
BACKENDS = ("metal", "cuda")
# The dispatch tiles M into threadgroups of at most 5 vectors (as qmv_wide does),
# so V = 2..5 covers every M in [2, batch limit).
STREAMED_VECS = (2, 3, 4, 5)
# The CUDA default route's floor: layers of fewer weights (n * k) keep stock's per-vector
# qmv at M = 2..7 (the smallest layer of the H200's cold grid where streaming won every M).
CUDA_STREAM_MIN_WEIGHTS = 1 << 24
# Edits whose template is a unified diff of upstream text (hunks.apply_diff), and
# edits that delete an upstream definition by name (no template).
PATCH_OPS = ("patch_function", "patch_file")
REMOVE_OPS = ("remove_function", "remove_macro")


@dataclass(frozen=True)
class RenderOptions:
    """What to render: which backends, which routing policy, which flavour.

    ``upstream`` is the pull-request flavour, ``overlay`` the whole-file one
    for downstream engines; the templates render the same code for both (the
    runtime switches are part of the PR), and export adds the overlay's file
    headers. ``cuda_x_staging`` picks the CUDA
    streamed qmv's memory plan; both keep qmv's per-thread order. ``smem`` (the
    default since the H200 runs of 2026-11-29: 2-3.5x faster than ``global``)
    stages x in shared memory with cp.async, gives each warp 2 rows and
    prefetches the weight rows into L2; ``global`` reads x from global memory
    per row, as qmv does (simpler, kept as the measured baseline).

    ``cuda_split_tail`` and ``cuda_stream_min_weights`` are the CUDA default route's
    policy, measured on an H200 with compiled MLX and weights read from HBM
    (``docs/benchmark_results/cuda-compiled-h200-2026-12-01-cold.md``; decision 0004).
    Left unset (None), they take the measured values where the split can run (routing
    ``stream``, ``smem``) and are off otherwise; ``split_tail`` and
    ``stream_min_weights`` give the values rendered.

    ``cuda_split_tail`` (default on) launches M = 5..7 of one batch (4-bit: M = 5, 6) as a
    V = 4 pass plus a V = 2 pass and/or stock's per-vector qmv, inside MLX's concurrent
    context, instead of two V = 4 tiles (4-bit) or stock's per-vector kernel (8-bit), and so
    streams 8-bit at M = 2..7. Every row still comes from the streamed kernel or qmv, in
    M = 1's order. Cold grid: 8-bit M = 5..7
    0.60-0.84 of stock on layers of 2**24 weights and more, where without it 8-bit M = 5..7
    kept stock's per-vector kernel (0.96-1.07: the run's noise).

    ``cuda_stream_min_weights`` (default ``CUDA_STREAM_MIN_WEIGHTS``, 2**24, with the split;
    0: no floor): below this many weights (n * k) M = 2..7 keep stock's per-vector qmv. Read
    from HBM (ncu, caches flushed), a 1024 x 1024 4-bit layer's streamed kernel took 1.3-2.1x
    stock's time at M = 2..7 (a grid of fewer blocks than the GPU has SMs), and the split's
    extra graph nodes cost more than a few-microsecond call saves. From 2**24 up, the cold
    grid read the route 0.34-0.90 of stock in every cell. Below it, the split is faster at
    some M and slower at others (kernel-only, 4096 x 1024 4-bit: 0.42-0.87 at M = 2, 3, 4, 7
    but 1.08 at M = 5; 2048 x 1024: 1.02-1.33 at M = 2, 3, 5, 6), so one floor for every
    width stays. The floor is part of the split's route and needs it: the route without the
    split (the two-argument ``use_qmv_streamed``) has no floor, which keeps the
    renders to two forms of that function.

    ``cuda_rows_per_warp`` (2 by default, or 1; smem only): the rows one warp of the
    streamed kernel owns, in blocks of 8 rows. 1 gives a block 8 warps, as qmv has, for a
    small layer whose grid does not fill the GPU and whose weights come from HBM, at the cost
    of reading each x slice from shared memory once per row instead of once per 2 rows. A
    timing arm until measured; no row's order depends on it.

    ``cuda_min_blocks_per_sm`` (0, no bound, by default; smem only; a timing arm until
    measured) puts ``__launch_bounds__`` on the streamed kernel's V >= 4 instances so that
    this many blocks fit an SM by registers. ptxas gives the 8-bit V = 4 kernel 161
    registers at sm_90a (12 resident warps per SM) where the mlxcel peer's 4-vector kernel
    takes 68 (24 warps); a bound trades spills for latency hiding, and no operation or
    order changes. V = 2 is bounded for the 5 blocks it reaches unbounded (8-bit: 96
    registers): with any looser bound, ptxas gave it 120-130 registers, fewer resident
    warps than without.

    ``cuda_async_tail`` (off by default; a timing arm until measured) copies the k steps
    past the last full stage of 4 as one more, shorter stage of the cp.async pipeline,
    while the stage before it is computed, instead of one step at a time with plain loads
    after the pipeline (K = 2560, 3584, 5120 or 9728 leave such steps). The same tiles in
    the same order: only when x reaches shared memory changes.
    """

    backends: tuple[str, ...] = BACKENDS
    routing: Routing = "stream"
    flavour: Flavour = "upstream"
    cuda_x_staging: CudaXStaging = "smem"
    cuda_split_tail: bool | None = None
    cuda_stream_min_weights: int | None = None
    cuda_rows_per_warp: int = 2
    cuda_async_tail: bool = False
    cuda_min_blocks_per_sm: int = 0

    @property
    def split_tail(self) -> bool:
        """``cuda_split_tail`` as rendered: unset, on where the split can run (routing
        ``stream``, ``smem`` staging). Left unset in the fields, so that
        ``dataclasses.replace`` of another routing or staging takes that one's default."""
        if self.cuda_split_tail is None:
            return self.routing == "stream" and self.cuda_x_staging == "smem"
        return self.cuda_split_tail

    @property
    def stream_min_weights(self) -> int:
        """``cuda_stream_min_weights`` as rendered: unset, the measured floor where the
        split runs and none otherwise (the floor belongs to the split's route)."""
        if self.cuda_stream_min_weights is None:
            return CUDA_STREAM_MIN_WEIGHTS if self.split_tail else 0
        return self.cuda_stream_min_weights

    def __post_init__(self) -> None:
        unknown = set(self.backends) - set(BACKENDS)
        if unknown:
            raise UserError(f"unknown backend {sorted(unknown)}; choose from {list(BACKENDS)}")
        if self.routing not in ("stream", "opt_in"):
            raise UserError(f"unknown routing '{self.routing}'; choose 'stream' or 'opt_in'")
        if self.flavour not in ("upstream", "overlay"):
            raise UserError(f"unknown flavour '{self.flavour}'; choose 'upstream' or 'overlay'")
        if self.cuda_x_staging not in ("global", "smem"):
            raise UserError(
                f"unknown cuda_x_staging '{self.cuda_x_staging}'; choose 'global' or 'smem'"
            )
        if self.split_tail and (self.routing, self.cuda_x_staging) != ("stream", "smem"):
            raise UserError("cuda_split_tail needs routing 'stream' and cuda_x_staging 'smem'")
        if self.stream_min_weights < 0:
            raise UserError("cuda_stream_min_weights must be 0 (no floor) or more")
        if self.stream_min_weights and not self.split_tail:
            raise UserError("cuda_stream_min_weights needs cuda_split_tail (routing 'stream')")
        if self.cuda_rows_per_warp not in (1, 2):
            raise UserError(f"cuda_rows_per_warp is 1 or 2, not {self.cuda_rows_per_warp}")
        if self.cuda_rows_per_warp != 2 and self.cuda_x_staging != "smem":
            raise UserError("cuda_rows_per_warp needs cuda_x_staging 'smem'")
        if self.cuda_async_tail and self.cuda_x_staging != "smem":
            raise UserError("cuda_async_tail needs cuda_x_staging 'smem'")
        if self.cuda_min_blocks_per_sm < 0:
            raise UserError("cuda_min_blocks_per_sm must be 0 (no bound) or more")
        if self.cuda_min_blocks_per_sm and self.cuda_x_staging != "smem":
            raise UserError("cuda_min_blocks_per_sm needs cuda_x_staging 'smem'")


@dataclass(frozen=True)
class Derive:
    """A variant of an upstream function, made from its text at render time."""

    function: str
    name: str
    rename: str
    replace: tuple[tuple[str, str], ...] = ()
    index: int | None = None


@dataclass(frozen=True)
class Lift:
    """Upstream statements, taken verbatim from a function at render time.

    A patch that moves upstream code into a shared helper lifts it: the helper's
    template receives the statements' text (with the comments above them), and
    a ``replace_statement`` edit with the same ``anchor``/``through`` puts the
    helper's call in their place.
    """

    name: str
    within: str
    statement: str
    through: str | None = None


@dataclass(frozen=True)
class Edit:
    """One structural insertion or replacement in an upstream file.

    ``within`` (a function name) scopes a statement anchor to that function;
    ``through`` extends a statement anchor to a range of statements.
    """

    op: str
    anchor: str
    template: str
    index: int | None = None
    within: str | None = None
    through: str | None = None


@dataclass(frozen=True)
class FilePlan:
    """Everything the patch does to one upstream file, as read from its ``edits.toml``."""

    path: str
    backend: str
    mirrored: tuple[str, ...]
    called: tuple[str, ...]
    derives: tuple[Derive, ...]
    lifts: tuple[Lift, ...]
    edits: tuple[Edit, ...]
    template_dir: Path = field(compare=False)


def load_plans(templates_dir: Path = TEMPLATES_DIR) -> list[FilePlan]:
    """Every file plan under ``templates_dir``, sorted by upstream path."""
    plans = []
    for manifest in sorted(templates_dir.rglob(MANIFEST)):
        try:
            plans.append(_load_plan(manifest, templates_dir))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise UserError(f"{manifest}: not valid TOML ({exc})") from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(
                f"{manifest}: missing or wrong entry ({exc}); every edits.toml needs backend"
                " and, per [[edit]], op, anchor and template"
            ) from exc
    return sorted(plans, key=lambda p: p.path)


def _load_plan(manifest: Path, templates_dir: Path) -> FilePlan:
    """One ``edits.toml`` as a plan (KeyError/TypeError for a missing or mistyped entry)."""
    data = tomllib.loads(manifest.read_text(encoding="utf-8"))
    rel = manifest.parent.relative_to(templates_dir).as_posix()
    deps = data.get("depends", {})
    return FilePlan(
        path=rel,
        backend=data["backend"],
        mirrored=tuple(deps.get("mirrored", ())),
        called=tuple(deps.get("called", ())),
        derives=tuple(
            Derive(
                function=d["function"],
                name=d["name"],
                rename=d["rename"],
                replace=tuple(tuple(r) for r in d.get("replace", ())),
                index=d.get("index"),
            )
            for d in data.get("derive", ())
        ),
        lifts=tuple(
            Lift(
                name=lf["name"],
                within=lf["within"],
                statement=lf["statement"],
                through=lf.get("through"),
            )
            for lf in data.get("lift", ())
        ),
        edits=tuple(
            Edit(
                op=e["op"],
                anchor=e["anchor"],
                template=e.get("template", "") if e["op"] in REMOVE_OPS else e["template"],
                index=e.get("index"),
                within=e.get("within"),
                through=e.get("through"),
            )
            for e in data.get("edit", ())
        ),
        template_dir=manifest.parent,
    )


def selected_plans(options: RenderOptions, templates_dir: Path = TEMPLATES_DIR) -> list[FilePlan]:
    """The plans for the backends ``options`` asks for."""
    return [p for p in load_plans(templates_dir) if p.backend in options.backends]


def derive(source: str, spec: Derive) -> str:
    """Derive a variant of an upstream function from the text of the tree being patched.

    The function is found by structure, its definition name is replaced, and the
    substitutions run inside its text only. A substitution that matches nothing
    is an error: it means upstream changed the function in a way the derivation
    no longer understands, and a silent no-op would change the kernel's meaning.
    """
    fn = cxx.find_function(source, spec.function, spec.index)
    text = fn.text(source)
    text, n = re.subn(rf"\b{re.escape(spec.function)}(\s*\()", rf"{spec.rename}\1", text, count=1)
    if n != 1:
        raise AnchorError(f"cannot rename '{spec.function}' while deriving '{spec.rename}'")
    for pattern, replacement in spec.replace:
        text, n = re.subn(pattern, replacement, text)
        if n == 0:
            raise AnchorError(
                f"deriving '{spec.rename}' from '{spec.function}': "
                f"pattern {pattern!r} no longer matches"
            )
    return text


def _statement_span(text: str, head: str, through: str | None, within: str | None) -> cxx.Span:
    """The span of statements ``head`` … ``through``, inside function ``within`` if given."""
    scope = cxx.find_function(text, within).span if within else None
    return cxx.find_statements(text, head, through, scope)


def lift(source: str, spec: Lift) -> str:
    """The text of the upstream statements ``spec`` names, with the comments above them."""
    start, end = _statement_span(source, spec.statement, spec.through, spec.within)
    return source[start:end].rstrip("\n")


def environment(template_dir: Path) -> jinja2.Environment:
    """The one Jinja environment for every template (snippets and the PR body)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        # Block tags take their own line in C++ snippets; trimming them keeps
        # the rendered code exactly as formatted in the template.
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


def context(options: RenderOptions, derived: dict[str, str]) -> dict[str, object]:
    """The Jinja context every snippet of a patch sees; harnesses use it to render the same text."""
    return {
        "flavour": options.flavour,
        "routing": options.routing,
        "vecs": list(STREAMED_VECS),
        "cuda_x_staging": options.cuda_x_staging,
        "cuda_split_tail": options.split_tail,
        "cuda_stream_min_weights": options.stream_min_weights,
        "cuda_rows_per_warp": options.cuda_rows_per_warp,
        "cuda_async_tail": options.cuda_async_tail,
        "cuda_min_blocks_per_sm": options.cuda_min_blocks_per_sm,
        **derived,
    }


def render_snippet(plan: FilePlan, template: str, context: dict[str, object]) -> str:
    """Render one snippet of ``plan`` with an explicit context (harnesses use this too)."""
    try:
        return environment(plan.template_dir).get_template(template).render(**context)
    except jinja2.UndefinedError as exc:
        raise UserError(f"{plan.path}/{template}: {exc.message}") from exc
    except jinja2.TemplateSyntaxError as exc:  # also unknown filters and tests
        where = f"{exc.name or template}:{exc.lineno}"
        raise UserError(f"{plan.path}/{where}: {exc.message}") from exc
    except jinja2.TemplateNotFound as exc:
        raise UserError(
            f"{plan.path}/{template}: template {exc.name!r} not found in {plan.template_dir}"
        ) from exc
    except UnicodeDecodeError as exc:
        raise UserError(f"{plan.path}/{template}: not UTF-8 text ({exc.reason})") from exc


def edit_snippet(plan: FilePlan, edit: Edit, context: dict[str, object]) -> str:
    """The text an edit inserts: a diff is read as it is (C++ braces are not Jinja)."""
    if edit.op in PATCH_OPS:
        path = plan.template_dir / edit.template
        try:
            return path.read_text(encoding="utf-8")
        except OSError as exc:
            raise UserError(f"{plan.path}/{edit.template}: cannot read ({exc.strerror})") from exc
    return render_snippet(plan, edit.template, context)


def _apply_edit(text: str | None, edit: Edit, snippet: str) -> str:
    """Apply one edit to ``text``; snippets are separated from upstream code by a blank line.

    Python files (MLX's tests, benchmarks) use :mod:`patchkit.carry.pyedit`'s ``ast``
    anchors; ``text`` is None only for a file that does not exist upstream.
    """
    op = edit.op
    if op in pyedit.PY_OPS:
        return pyedit.apply_edit(text, op, edit.anchor, snippet)
    if text is None:
        raise AnchorError(f"'{op}' needs an upstream file, and there is none")
    if op == "patch_function":
        fn = cxx.find_function(text, edit.anchor, edit.index)
        start, end = fn.span
        return text[:start] + hunks.apply_diff(text[start:end], snippet, edit.anchor) + text[end:]
    if op == "patch_file":
        return hunks.apply_diff(text, snippet, edit.anchor)
    if op == "remove_function":
        fn = cxx.find_function(text, edit.anchor, edit.index)
        return _remove(text, fn.span)
    if op == "remove_macro":
        return _remove(text, cxx.find_macro(text, edit.anchor))
    if op == "after_function":
        fn = cxx.find_function(text, edit.anchor, edit.index)
        at = cxx.line_end(text, fn.span[1] - 1)
        return text[:at] + "\n" + snippet + text[at:]
    if op in ("before_statement", "replace_statement"):
        start, end = _statement_span(text, edit.anchor, edit.through, edit.within)
        if op == "before_statement":
            return text[:start] + snippet + text[start:]
        return text[:start] + snippet + text[end:]
    if op == "after_macro":
        _, end = cxx.find_macro(text, edit.anchor)
        return text[:end] + "\n" + snippet + text[end:]
    if op == "append_to_macro":
        _, end = cxx.find_macro(text, edit.anchor)
        body_end = end - 1 if text[end - 1] == "\n" else end
        last_line_start = text.rfind("\n", 0, body_end) + 1
        last_line = text[last_line_start:body_end]
        added = snippet.rstrip("\n").split("\n")
        lines = [last_line.rstrip() + " \\"] + [
            (line + " \\") if i < len(added) - 1 else line for i, line in enumerate(added)
        ]
        return text[:last_line_start] + "\n".join(lines) + text[body_end:]
    raise UserError(f"unknown edit op '{op}' for anchor '{edit.anchor}'")


def _remove(text: str, span: cxx.Span) -> str:
    """``text`` without ``span``, the comment lines directly above it and one blank line."""
    start = cxx.leading_comment_start(text, text.rfind("\n", 0, span[0]) + 1)
    end = cxx.line_end(text, span[1] - 1)
    if text[end : end + 1] == "\n":
        end += 1  # the blank line that separated it from what follows
    return text[:start] + text[end:]


def render_file(
    plan: FilePlan,
    upstream_text: str | None,
    options: RenderOptions,
    extra_context: dict[str, object] | None = None,
) -> str:
    """The patched text of one upstream file (``None``: a file new upstream).

    ``extra_context`` adds values some snippets need (export-pr's test bounds).
    """
    derived = {d.name: derive(upstream_text or "", d) for d in plan.derives}
    derived |= {lf.name: lift(upstream_text or "", lf) for lf in plan.lifts}
    ctx = {**context(options, derived), **(extra_context or {})}
    text = upstream_text
    for edit in plan.edits:
        if edit.op in REMOVE_OPS:
            text = _apply_edit(text, edit, "")
            continue
        snippet = edit_snippet(plan, edit, ctx)
        if not snippet.strip():
            continue  # an option turned this edit off
        text = _apply_edit(text, edit, snippet)
    if text is None:
        raise UserError(f"{plan.path}: its edits.toml has no edits")
    return text


def changed_functions(old: str, new: str, names: Iterable[str]) -> list[str]:
    """Names whose definition text differs between two versions of a file (or vanished)."""
    changed = []
    for name in names:
        try:
            before = [f.text(old) for f in cxx.find_functions(old, name)]
            after = [f.text(new) for f in cxx.find_functions(new, name)]
        except AnchorError:
            changed.append(name)
            continue
        if before != after:
            changed.append(name)
    return changed
