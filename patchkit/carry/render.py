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

Two kinds of plan: the kernel files (``backend = "metal"``/``"cuda"``), which
the series and the overlay carry, each flavour rendered once
(:func:`render_all`); and the files only an upstream pull request carries (MLX's
test and benchmark, ``backend = "pr"``: :func:`pr_plans`, :func:`render_pr_file`),
which ``export-pr`` commits and ``build`` renders into the tree it compiles.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import jinja2

from patchkit.carry import cxx, hunks, pyedit
from patchkit.errors import AnchorError, UserError

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"
MANIFEST = "edits.toml"

Flavour = Literal["upstream", "overlay"]
# The changes, in series order: two fixes, each its own upstream PR (Metal's JIT
# template arguments; CUDA's qmm_sm90 off where its parameter layout disagrees),
# then Metal and CUDA.
BACKENDS = ("jit-fix", "qmm-sm90", "metal", "cuda")
# The branch `export-pr` makes for each change's PR by default: one per backend, so
# exporting one never moves another's. Here, not in export_pr, so the CLI's help reads
# them without importing the exporter at start-up.
DEFAULT_BRANCHES = {
    "jit-fix": "qmv-jit-template-args",
    "qmm-sm90": "qmm-sm90-param-layout",
    "metal": "order-preserving-qmv",
    "cuda": "order-preserving-qmv-cuda",
}
# What a change's edits are written against: Metal's host diff builds on the JIT fix.
REQUIRES = {"metal": ("jit-fix",)}
# The dispatch tiles M into threadgroups of at most 5 vectors (as qmv_wide does),
# so V = 2..5 covers every M in [2, batch limit).
STREAMED_VECS = (2, 3, 4, 5)
# Edits whose template is a unified diff of upstream text (hunks.apply_diff), and
# edits that delete an upstream definition by name (no template).
PATCH_OPS = ("patch_function", "patch_file", "patch_method")
REMOVE_OPS = ("remove_function", "remove_macro")
# Plans of the files only the pull request carries (MLX's test and benchmark).
PR_BACKEND = "pr"
# Largest M the test asserts: the smallest qmv batch limit for K, N <= 2048 on any
# Apple GPU generation is 13, and M >= limit goes to qmm, which sums differently.
TEST_MAX_M = 12
# Benchmark shapes (K x N) the test and benchmark templates name: a 4096-wide model's
# attention and MLP projections, the sizes a speculative-decoding verify runs at small M.
BENCH_SIZES = ((4096, 4096), (4096, 14336), (14336, 4096))


@dataclass(frozen=True)
class RenderOptions:
    """What to render: which backends, which flavour.

    ``upstream`` is the pull-request flavour, ``overlay`` the whole-file one
    for downstream engines. The CUDA templates render the downstream knobs
    (``MLX_CUDA_QMV_EXACT``, the off switch ``MLX_CUDA_QMV_SHARED_WEIGHTS=0``) in the
    overlay only; the upstream render has no environment variable. The CUDA kernel's
    launch constants are measured choices in the template, not options
    (``docs/results/cuda-kernel.md``).
    """

    backends: tuple[str, ...] = BACKENDS
    flavour: Flavour = "upstream"
    # Also render the changes each backend builds on (REQUIRES); off only to render a
    # change alone onto a tree that already holds them (a stacked export-pr).
    with_required: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.backends) - set(BACKENDS)
        if unknown:
            raise UserError(f"unknown backend {sorted(unknown)}; choose from {list(BACKENDS)}")
        if self.with_required:
            wanted = {r for b in self.backends for r in REQUIRES.get(b, ())} | set(self.backends)
            object.__setattr__(self, "backends", tuple(b for b in BACKENDS if b in wanted))
        if self.flavour not in ("upstream", "overlay"):
            raise UserError(f"unknown flavour '{self.flavour}'; choose 'upstream' or 'overlay'")


DEFAULT_OPTIONS = RenderOptions()


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
    ``through`` extends a statement anchor to a range of statements; ``flavour``
    limits the edit to one flavour (the overlay keeps what the PR removes, for its
    off switch); ``backend`` gives the edit a change of its own, committed (and
    exported) before the file's (the JIT fix inside the Metal host file).
    """

    op: str
    anchor: str
    template: str
    index: int | None = None
    within: str | None = None
    through: str | None = None
    flavour: Flavour | None = None
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.flavour not in (None, "upstream", "overlay"):
            raise ValueError(f"flavour must be 'upstream' or 'overlay', not {self.flavour!r}")


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
                flavour=e.get("flavour"),
                backend=e.get("backend"),
            )
            for e in data.get("edit", ())
        ),
        template_dir=manifest.parent,
    )


def selected_plans(options: RenderOptions, templates_dir: Path = TEMPLATES_DIR) -> list[FilePlan]:
    """The plans with an edit for the backends ``options`` asks for."""
    return [p for p in load_plans(templates_dir) if _selected(p, options)]


def _selected(plan: FilePlan, options: RenderOptions) -> bool:
    """Whether ``plan`` has an edit for the backends ``options`` asks for."""
    return plan.backend in options.backends or any(
        e.backend in options.backends for e in plan.edits
    )


def selects(plan: FilePlan, edit: Edit, options: RenderOptions) -> bool:
    """Whether ``options`` renders ``edit``: its flavour, and its change (the edit's own
    ``backend``, else the file's). PR-only files render every edit (Jinja picks inside)."""
    if edit.flavour not in (None, options.flavour):
        return False
    return plan.backend == PR_BACKEND or (edit.backend or plan.backend) in options.backends


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
        "vecs": list(STREAMED_VECS),
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
    """The text an edit inserts, rendered with the patch's context. A diff template
    (``*.diff.j2``) renders like any other, flavour differences inside it, and its hunk
    headers are then recounted from what rendered (:func:`hunks.recount`)."""
    snippet = render_snippet(plan, edit.template, context)
    return hunks.recount(snippet) if edit.op in PATCH_OPS else snippet


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
    text = _render_text(plan, upstream_text, options, extra_context)
    if text is None:
        raise UserError(f"{plan.path}: its edits.toml has no edits")
    return text


def _render_text(
    plan: FilePlan,
    upstream_text: str | None,
    options: RenderOptions,
    extra_context: dict[str, object] | None = None,
) -> str | None:
    """:func:`render_file`'s work; None when the file is new and no edit wrote it."""
    derived = {d.name: derive(upstream_text or "", d) for d in plan.derives}
    derived |= {lf.name: lift(upstream_text or "", lf) for lf in plan.lifts}
    ctx = {**context(options, derived), **(extra_context or {})}
    text = upstream_text
    for edit in plan.edits:
        if not selects(plan, edit, options):
            continue
        if edit.op in REMOVE_OPS:
            text = _apply_edit(text, edit, "")
            continue
        snippet = edit_snippet(plan, edit, ctx)
        if not snippet.strip():
            continue  # an option turned this edit off
        try:
            text = _apply_edit(text, edit, snippet)
        except AnchorError as exc:  # which template's anchor or hunk no longer fits
            raise AnchorError(f"{edit.template or edit.op}: {exc}") from exc
    return text


def render_both(plan: FilePlan, text: str, options: RenderOptions) -> tuple[str, str]:
    """``text`` patched in ``options``' flavour and in the overlay flavour, each rendered once."""
    patched = render_file(plan, text, options)
    if options.flavour == "overlay":
        return patched, patched
    return patched, render_file(plan, text, replace(options, flavour="overlay"))


@dataclass(frozen=True)
class Rendered:
    """A rendered patch: the upstream texts and both flavours of the patched texts.

    ``patched`` is what the series commits (the options' flavour), ``overlay``
    the whole files for downstream engines (empty when not asked for). ``stages``
    are the patched texts after each change in series order, each including the
    ones before it (one commit each); ``backend_of`` the change of each file, for
    texts that could not be staged (a rebase's three-way merge).
    """

    upstream: dict[str, str] = field(default_factory=dict)
    patched: dict[str, str] = field(default_factory=dict)
    overlay: dict[str, str] = field(default_factory=dict)
    backend_of: dict[str, str] = field(default_factory=dict)
    stages: list[tuple[str, dict[str, str]]] = field(default_factory=list)


def touched(options: RenderOptions, templates_dir: Path) -> list[str]:
    """Upstream paths the templates in ``templates_dir`` edit; empty templates are an error."""
    paths = [p.path for p in selected_plans(options, templates_dir)]
    if not paths:
        raise UserError(
            f"no templates for backends {list(options.backends)} under {templates_dir};"
            " add templates/<upstream path>/edits.toml or choose other --backend values"
        )
    return paths


def render_all(
    read: Callable[[str], str],
    options: RenderOptions,
    templates_dir: Path,
    *,
    overlay: bool = True,
) -> Rendered:
    """Render every touched file: upstream text, patched text and (``overlay``) the overlay."""
    rendered = Rendered()
    for plan in selected_plans(options, templates_dir):
        text = read(plan.path)
        try:
            if overlay:
                both = render_both(plan, text, options)
                rendered.patched[plan.path], rendered.overlay[plan.path] = both
            else:
                rendered.patched[plan.path] = render_file(plan, text, options)
        except AnchorError as exc:
            raise AnchorError(f"{plan.path}: {exc}") from exc
        rendered.upstream[plan.path] = text
        rendered.backend_of[plan.path] = plan.backend
    add_stages(rendered, selected_plans(options, templates_dir), options)
    return rendered


def add_stages(rendered: Rendered, plans: list[FilePlan], options: RenderOptions) -> None:
    """Fill ``rendered.stages``, one commit per change: the changes before the last rendered
    from the upstream texts ``rendered`` holds, then its whole patched texts."""
    order = [b for b in BACKENDS if b in options.backends]
    earlier = replace(options, backends=tuple(order[:-1]))
    rendered.stages.extend(render_stages(rendered.upstream.__getitem__, earlier, plans))
    rendered.stages.append((order[-1], rendered.patched))


def render_stages(
    read: Callable[[str], str], options: RenderOptions, plans: list[FilePlan]
) -> list[tuple[str, dict[str, str]]]:
    """The patched texts of ``plans`` after each change of ``options`` in series order
    (``BACKENDS``: the two fixes, Metal, CUDA), each stage rendered with the changes before it."""
    order = [b for b in BACKENDS if b in options.backends]
    stages = []
    for i, backend in enumerate(order):
        upto = replace(options, backends=tuple(order[: i + 1]))
        texts = {p.path: render_file(p, read(p.path), upto) for p in plans if _selected(p, upto)}
        stages.append((backend, texts))
    return stages


def pr_plans(templates_dir: Path) -> list[FilePlan]:
    """The plans only the PR carries (tests, benchmarks): ``backend = "pr"`` in edits.toml."""
    return [p for p in load_plans(templates_dir) if p.backend == PR_BACKEND]


def pr_test_methods(templates_dir: Path = TEMPLATES_DIR) -> list[str]:
    """The test methods the PR-only edits add to MLX's tests (snippets of new members), in
    plan order: what a run of stock MLX beside a build shows failing on main's code, as
    MLX asks of a new test. Edits of upstream's own methods add none."""
    names: list[str] = []
    for plan in pr_plans(templates_dir):
        for edit in plan.edits:
            if edit.op in pyedit.ADDING_OPS:
                text = (plan.template_dir / edit.template).read_text()
                names += pyedit.TEST_METHOD_DEF.findall(text)
    return names


def pr_context(options: RenderOptions) -> dict[str, object]:
    """Jinja context for the PR-only snippets: which backends the PR covers, test bounds."""
    return {
        "backends": list(options.backends),
        "flavour": "upstream",
        "max_m": TEST_MAX_M,
        "bench_sizes": ",".join(f"{k}x{n}" for k, n in BENCH_SIZES),
    }


def render_pr_file(plan: FilePlan, text: str | None, options: RenderOptions) -> str | None:
    """Patched text of one PR-only file (``text`` is None for a file new upstream); None
    when the file is new and ``options``' PR does not carry it (every snippet empty)."""
    try:
        return _render_text(plan, text, options, pr_context(options))
    except AnchorError as exc:
        raise AnchorError(f"{plan.path}: {exc}") from exc


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
