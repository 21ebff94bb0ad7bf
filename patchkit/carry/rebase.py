"""``patchkit rebase --to REV``: move the pin, gated on exactness rather than on "it applied".

A patch that still applies can silently stop meaning what it did. So before
anything is written, rebase:

1. diffs, between the old and the new pin, the upstream functions each template
   declares it depends on (``[depends]`` in ``edits.toml``): *mirrored* ones (the
   M = 1 kernels whose lane mapping and summation order the streamed kernel
   reproduces) and *called* ones (helpers it calls or derives from);
2. refuses if any mirrored function changed, naming it;
2b. refuses if any *routing* function changed (``routing`` in ``[depends]``: the
   upstream functions that decide which kernel a shape reaches), naming it and
   showing upstream's diff, until the user passes ``accept_routing=True``
   (``--accept-routing-change``) after reading it; parity still runs after;
3. re-renders against the new tree (structural anchors follow moved code); a
   file whose anchor is gone falls back to a 3-way ``git merge-file`` of old
   upstream -> new upstream into the old rendered file, and conflicts are
   reported with file and line range and refuse the rebase;
4. runs the parity suites the caller passes (the CLI: the CPU emulator's, from
   :mod:`patchkit.verify.rebase_gate`) on the new patched ``quantized.h`` and
   ``fp_quantized.h``; a failure refuses, and changed called functions are only
   accepted with parity passing (a suite not given cannot accept them).

Only then are ``patches/<new>/`` and ``pin.toml`` written (staged, then renamed),
and the old ``patches/<old>/`` dropped. Every refusal raises before any write.
Rebase holds the checkout's and the clone's locks throughout, like apply.
"""

from __future__ import annotations

import difflib
import hashlib
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from patchkit.carry import callgraph, cxx, export, pin, render, source, transaction
from patchkit.errors import AnchorError, BlobMismatchError, UserError
from patchkit.util import git, staging

PARITY_FILE = "mlx/backend/metal/kernels/quantized.h"
FP_PARITY_FILE = "mlx/backend/metal/kernels/fp_quantized.h"
FP_TYPE_FILES = ("mlx/backend/metal/kernels/fp4.h", "mlx/backend/metal/kernels/fp8.h")


class RebaseRefused(UserError):
    """The new tree changes what the patch means (a mirrored function, or parity fails)."""


class RoutingChanged(RebaseRefused):
    """Upstream changed a function that decides which kernel a shape reaches."""


class MergeConflictError(UserError):
    """The 3-way fallback for a file whose anchor vanished left conflicts."""


@dataclass(frozen=True)
class Parity:
    """The part of a parity suite's report rebase needs."""

    ok: bool
    summary: str
    failures: tuple[str, ...] = ()


# A suite takes the new tree's header as upstream has it and with the patch rendered
# in: the patched kernels at V > 1 are checked against upstream's own M = 1 kernels.
# The caller passes the suites (the CLI: patchkit.verify.rebase_gate), so the pipeline
# never imports the verifier; a suite not given, or returning None, is not available.
ParityCheck = Callable[[str, str], Parity | None]
# The fp suite also needs the new tree's fp4.h and fp8.h, which define the fp types.
FpParityCheck = Callable[[str, str, tuple[str, str]], Parity | None]


@dataclass
class Conflict:
    """One conflicted region left by ``git merge-file``."""

    path: str
    first_line: int
    last_line: int
    anchor: str = ""  # the template anchor whose loss sent the file to the merge

    def __str__(self) -> str:
        return self.anchor or f"{self.path}:{self.first_line}-{self.last_line}"


@dataclass
class RebaseResult:
    """What rebase found and did."""

    old: str
    new: str
    changed_mirrored: dict[str, list[str]] = field(default_factory=dict)
    changed_called: dict[str, list[str]] = field(default_factory=dict)
    changed_routing: dict[str, list[str]] = field(default_factory=dict)
    routing: dict[str, str] = field(default_factory=dict)  # "path: name" -> fingerprint at old
    unfingerprinted: list[str] = field(default_factory=list)  # declared, found at neither pin
    merged_files: list[str] = field(default_factory=list)
    parity: Parity | None = None
    fp_parity: Parity | None = None
    head: str = ""
    patches_dir: str = ""
    written: bool = False
    gate_s: float | None = None  # wall seconds of the parity gate

    def summary(self) -> str:
        """One human paragraph."""
        if not self.written and self.old == self.new:
            return f"already pinned at {self.old[:8]}: nothing to do"
        called = ", ".join(f for fs in self.changed_called.values() for f in fs) or "none"
        parity = (
            ", ".join(
                f"{name} {_verdict_word(p)}"
                for name, p in (("affine", self.parity), ("fp", self.fp_parity))
                if p is not None
            )
            or "not run"
        )
        if self.gate_s is not None:
            parity += f" in {self.gate_s:.0f} s (details: --json)"
        routing = ", ".join(f for fs in self.changed_routing.values() for f in fs)
        rows = [
            ("changed called functions", called),
            ("routing changes accepted", routing or "none"),
            ("parity", parity),
            ("merged by 3-way", ", ".join(self.merged_files) or "none"),
            ("wrote", self.patches_dir),
        ]
        if self.unfingerprinted:
            rows.append(("not fingerprinted", ", ".join(self.unfingerprinted)))
        width = max(len(k) for k, _ in rows)
        head = f"rebased {self.old[:8]} -> {self.new[:8]} (patch head {self.head[:8]})"
        return "\n".join([head, *(f"  {k.ljust(width)}  {v}" for k, v in rows)])

    def to_json(self) -> dict[str, Any]:
        """A JSON-friendly summary."""
        return {
            "old": self.old,
            "new": self.new,
            "changed_mirrored": self.changed_mirrored,
            "changed_called": self.changed_called,
            "changed_routing": self.changed_routing,
            "routing": self.routing,
            "unfingerprinted": self.unfingerprinted,
            "merged_files": self.merged_files,
            "parity": None
            if self.parity is None
            else self.parity.__dict__ | {"failures": list(self.parity.failures)},
            "fp_parity": None
            if self.fp_parity is None
            else self.fp_parity.__dict__ | {"failures": list(self.fp_parity.failures)},
            "head": self.head,
            "patches_dir": self.patches_dir,
            "written": self.written,
            "gate_s": self.gate_s,
        }


def changed_dependencies(
    plans: list[render.FilePlan], old_read: Callable[[str], str], new_read: Callable[[str], str]
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """``({path: mirrored changed}, {path: called changed})`` between two trees."""
    mirrored, called = {}, {}
    for plan in plans:
        old_text, new_text = old_read(plan.path), new_read(plan.path)
        if m := render.changed_functions(old_text, new_text, plan.mirrored):
            mirrored[plan.path] = m
        if c := render.changed_functions(old_text, new_text, plan.called):
            called[plan.path] = c
    return mirrored, called


@dataclass(frozen=True)
class RoutingFunction:
    """An upstream function that decides which kernel a shape reaches."""

    path: str  # upstream file that defines it
    name: str  # as cxx finds it; Class::method for a member defined out of line
    manifest: str  # the edits.toml that declares it

    def __str__(self) -> str:
        return f"{self.path}: {self.name}"


def routing_functions(plans: list[render.FilePlan]) -> list[RoutingFunction]:
    """``routing`` of every plan's ``[depends]``: ``"name"`` (in the plan's own file) or
    ``{ function = "name", path = "upstream/file" }`` (a file the patch does not edit)."""
    found = []
    for plan in plans:
        manifest = plan.template_dir / render.MANIFEST
        deps = tomllib.loads(manifest.read_text(encoding="utf-8")).get("depends", {})
        for entry in deps.get("routing", ()):
            if isinstance(entry, str):
                found.append(RoutingFunction(plan.path, entry, str(manifest)))
            elif isinstance(entry, dict) and {"function"} <= entry.keys() <= {"function", "path"}:
                path = entry.get("path", plan.path)
                found.append(RoutingFunction(path, entry["function"], str(manifest)))
            else:
                raise UserError(
                    f"{manifest}: routing entries are names or {{ function = ..., path = ... }},"
                    f" not {entry!r}"
                )
    return found


def _definitions(clone: Path, commit: str, fn: RoutingFunction) -> list[str] | None:
    """Text of every definition of ``fn`` at ``commit``; None when its file is absent."""
    if git.blob_id(clone, commit, fn.path) is None:
        return None
    text = git.show_file(clone, commit, fn.path)
    try:
        return [f.text(text) for f in cxx.find_functions(text, fn.name)]
    except AnchorError:
        return []  # unbalanced text: nothing to fingerprint


def fingerprint(definitions: list[str]) -> str:
    """A short id of a function's definitions, for reports."""
    return hashlib.sha256("\0".join(definitions).encode()).hexdigest()[:16]


def changed_routing(
    fns: list[RoutingFunction], clone: Path, old: str, new: str
) -> tuple[dict[str, str], dict[RoutingFunction, str], list[str]]:
    """``(fingerprints at old, {changed: upstream diff}, unfingerprinted)`` between two pins."""
    prints, changed, missing = {}, {}, []
    for fn in fns:
        before = _definitions(clone, old, fn)
        if not before:
            missing.append(f"{fn} (declared in {fn.manifest})")
            continue
        prints[str(fn)] = fingerprint(before)
        after = _definitions(clone, new, fn) or []
        if after != before:
            diff = difflib.unified_diff(
                "\n".join(before).splitlines(keepends=True),
                "\n".join(after).splitlines(keepends=True),
                f"{fn.path} @ {old[:8]} ({fn.name})",
                f"{fn.path} @ {new[:8]} ({fn.name}{'' if after else ': gone'})",
            )
            changed[fn] = "".join(line if line.endswith("\n") else line + "\n" for line in diff)
    return prints, changed, missing


DERIVED = "the call graph from each eval_gpu (derived, not declared)"


def _edited(plan: render.FilePlan) -> set[str]:
    """The functions a plan edits or mirrors: where the route a gate follows ends."""
    deps = tomllib.loads((plan.template_dir / render.MANIFEST).read_text(encoding="utf-8"))
    return set(deps.get("depends", {}).get("edited", ())) | set(plan.mirrored)


def derived_routing(
    clone: Path, commit: str, plans: list[render.FilePlan]
) -> dict[tuple[str, str], list[str]]:
    """``{(path, name): definitions}`` on the route to the patched functions at ``commit``,
    per backend, from the host sources of the folders the patch edits (:mod:`callgraph`)."""
    groups: dict[str, tuple[set[str], set[str]]] = {}
    for plan in plans:
        for folder in callgraph.folders_of([plan.path]):
            top = "/".join(folder.split("/")[:3])  # mlx/backend/<backend>: one graph each
            folders, targets = groups.setdefault(top, (set(), set()))
            folders.add(folder)
            targets.update(_edited(plan))
    found: dict[tuple[str, str], list[str]] = {}
    for folders, targets in groups.values():
        files = {
            path: git.show_file(clone, commit, path)
            for folder in sorted(folders)
            for path in git.out(clone, "ls-tree", "--name-only", commit, folder + "/").split()
            if path.endswith(callgraph.HOST_SUFFIXES)
        }
        found.update(callgraph.route_in(files, targets))
    return found


def changed_route(
    clone: Path, old: str, new: str, plans: list[render.FilePlan], declared: set[str]
) -> tuple[dict[str, str], dict[RoutingFunction, str]]:
    """Fingerprints and changes of the derived route not already ``declared``: a function
    whose text changed, or that joined or left the route (a new caller, a new predicate)."""
    before_all, after_all = (derived_routing(clone, c, plans) for c in (old, new))
    prints, changed = {}, {}
    for key in sorted(before_all.keys() | after_all.keys()):
        fn = RoutingFunction(key[0], key[1], DERIVED)
        if str(fn) in declared:
            continue
        before, after = before_all.get(key, []), after_all.get(key, [])
        if before:
            prints[str(fn)] = fingerprint(before)
        if before == after:
            continue
        note = "" if before and after else (
            f"# {fn}: {'now on' if after else 'no longer on'} the route to the patched kernels\n"
        )  # fmt: skip
        diff = difflib.unified_diff(
            "\n".join(before).splitlines(keepends=True),
            "\n".join(after).splitlines(keepends=True),
            f"{fn.path} @ {old[:8]} ({fn.name})",
            f"{fn.path} @ {new[:8]} ({fn.name})",
        )
        changed[fn] = note + "".join(ln if ln.endswith("\n") else ln + "\n" for ln in diff)
    return prints, changed


def gate_routing(
    result: RebaseResult,
    clone: Path,
    fns: list[RoutingFunction],
    accept: bool,
    plans: list[render.FilePlan] | None = None,
) -> None:
    """Refuse a routing change (named, its diff attached) unless ``accept``; record it.

    The route is the declared functions and, with ``plans``, the one derived from the
    source at both commits (:func:`changed_route`)."""
    result.routing, changed, missing = changed_routing(fns, clone, result.old, result.new)
    if plans is not None:
        prints, more = changed_route(clone, result.old, result.new, plans, set(map(str, fns)))
        result.routing |= prints
        changed |= more
    result.unfingerprinted += missing
    for fn in changed:
        result.changed_routing.setdefault(fn.path, []).append(fn.name)
    if changed and not accept:
        names = "; ".join(map(str, changed))
        exc = RoutingChanged(
            f"{result.new[:8]} changes upstream routing, which decides the kernel each shape"
            f" reaches ({names}); read the diff below, update the templates if the patch's"
            " route must follow, then retry with --accept-routing-change"
        )
        exc.details = "".join(changed.values())
        raise exc


STATEMENT_OPS = ("before_statement", "replace_statement")


def changed_anchors(
    plans: list[render.FilePlan], old_read: Callable[[str], str], new_read: Callable[[str], str]
) -> dict[str, list[str]]:
    """``{path: ["template at 'anchor'", ...]}`` for anchored statements upstream edited.

    A snippet inserted before a routing statement, or one that replaces it,
    assumes what that statement does. If upstream changes the statement (say,
    narrows ``M >= 2`` to ``M >= 2 && M <= 8``), the anchor still matches and a
    render or merge succeeds, yet the patch may now shadow upstream's new rule.
    Only a person can judge that, so rebase refuses and names the block.
    """
    found: dict[str, list[str]] = {}
    for plan in plans:
        old_text, new_text = old_read(plan.path), new_read(plan.path)
        for edit in plan.edits:
            if edit.op not in STATEMENT_OPS:
                continue
            try:
                old_span = render._statement_span(old_text, edit.anchor, edit.through, edit.within)
                new_span = render._statement_span(new_text, edit.anchor, edit.through, edit.within)
            except AnchorError:
                continue  # a vanished anchor goes to the 3-way merge, which reports it
            if old_text[slice(*old_span)] != new_text[slice(*new_span)]:
                found.setdefault(plan.path, []).append(f"{edit.template} at '{edit.anchor}'")
    return found


def conflicts_in(path: str, text: str) -> list[Conflict]:
    """Conflict regions (``<<<<<<<`` .. ``>>>>>>>``) in a merged text, 1-based lines."""
    found, start = [], None
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("<<<<<<< "):
            start = n
        elif line.startswith(">>>>>>> ") and start is not None:
            found.append(Conflict(path, start, n))
            start = None
    return found


def merge_three(base: str, current: str, other: str, path: str) -> tuple[str, list[Conflict]]:
    """``git merge-file``: carry base -> other into current; return text and conflicts."""
    with staging.scratch("merge") as tmp:
        files = {}
        for name, text in (("current", current), ("base", base), ("other", other)):
            files[name] = Path(tmp) / name
            files[name].write_bytes(text.encode("utf-8", "surrogateescape"))
        git.merge_file(None, files["current"], files["base"], files["other"])
        merged = files["current"].read_bytes().decode("utf-8", "surrogateescape")
    return merged, conflicts_in(path, merged)


def render_or_merge(
    plans: list[render.FilePlan],
    old_read: Callable[[str], str],
    new_read: Callable[[str], str],
    options: render.RenderOptions,
) -> tuple[render.Rendered, list[str], list[Conflict]]:
    """Render each file on the new tree; 3-way merge the ones whose anchors vanished."""
    rendered = render.Rendered()
    merged, conflicts = [], []
    for plan in plans:
        new_text = new_read(plan.path)
        try:
            patched, overlay = render.render_both(plan, new_text, options)
        except AnchorError as exc:
            lost = f"{plan.path}: {exc}"  # which template's anchor failed
            old_text = old_read(plan.path)
            try:
                old_patched, old_overlay = render.render_both(plan, old_text, options)
            except AnchorError:
                raise AnchorError(f"{plan.path}: {exc}") from exc
            patched, c1 = merge_three(old_text, old_patched, new_text, plan.path)
            overlay, c2 = merge_three(old_text, old_overlay, new_text, plan.path)
            conflicts += [replace(c, anchor=lost) for c in (c1 or c2)]
            merged.append(plan.path)
        rendered.upstream[plan.path] = new_text
        rendered.patched[plan.path] = patched
        rendered.overlay[plan.path] = overlay
        rendered.backend_of[plan.path] = plan.backend
    if not merged:  # a merged text cannot be staged: commit.stages_of falls back to backend_of
        render.add_stages(rendered, plans, options)
    return rendered, merged, conflicts


def gate_parity(
    result: RebaseResult,
    rendered: render.Rendered,
    parity_check: ParityCheck | None,
    fp_parity_check: FpParityCheck | None = None,
    new_read: Callable[[str], str] | None = None,
) -> None:
    """Run parity on the new quantized.h (and fp_quantized.h) and refuse on failure.

    Changed called functions are accepted only when a suite judged them; a
    failing suite refuses whatever changed.
    """
    called = sorted({f for fs in result.changed_called.values() for f in fs})
    if PARITY_FILE in rendered.patched:
        upstream, patched = rendered.upstream[PARITY_FILE], rendered.patched[PARITY_FILE]
        result.parity = parity_check(upstream, patched) if parity_check else None
        _judge(result.parity, called, result.new, "patchkit.verify.emulate.verify_header")
    if new_read and FP_PARITY_FILE in rendered.patched:
        types = (new_read(FP_TYPE_FILES[0]), new_read(FP_TYPE_FILES[1]))
        upstream, patched = rendered.upstream[FP_PARITY_FILE], rendered.patched[FP_PARITY_FILE]
        result.fp_parity = fp_parity_check(upstream, patched, types) if fp_parity_check else None
        _judge(result.fp_parity, called, result.new, "patchkit.verify.emulate.verify_fp_header")


def _judge(parity: Parity | None, called: list[str], new: str, suite: str) -> None:
    """Refuse when the suite failed, or could not run while called functions changed."""
    if parity is None:
        if called:
            raise RebaseRefused(
                f"called functions changed ({', '.join(called)}) and the CPU parity suite"
                f" ({suite}) is not available to judge them; install it and retry"
            )
        return
    if not parity.ok:
        first = parity.failures[0] if parity.failures else parity.summary
        raise RebaseRefused(
            f"parity fails on {new[:8]} (changed called functions:"
            f" {', '.join(called) or 'none'}): {first}"
        )


def rebase(
    rev: str,
    *,
    root: Path,
    mlx_repo: str | None = None,
    templates_dir: Path = render.TEMPLATES_DIR,
    options: render.RenderOptions = render.DEFAULT_OPTIONS,
    release: str | None = None,
    progress: source.Progress = source._quiet,
    parity_check: ParityCheck | None = None,
    fp_parity_check: FpParityCheck | None = None,
    allow_downgrade: bool = False,
    accept_routing: bool = False,
    wait: bool = True,
) -> RebaseResult:
    """Move the pin to ``rev``; see the module doc for the gates. Writes only on success.

    ``rev`` equal to the pin is a no-op (nothing read beyond the revision, nothing
    written). A ``rev`` that does not descend from the pin (older, or another
    line of history) is refused unless ``allow_downgrade``.
    """
    if release:
        pin.check_release(release)
    with transaction.writer(root, wait=wait, progress=progress):
        transaction.ensure_outputs_clean(root)
        old_pin = pin.load(root / pin.PIN_FILE)
        clone = source.open_source(mlx_repo, old_pin.url, progress=progress)
        with source.locked_clone(clone, wait=wait, progress=progress):
            new = source.resolve(clone, rev, progress=progress)
            old = source.resolve(clone, old_pin.commit, progress=progress)
            result = RebaseResult(old, new)
            if new == old:
                return result
            _refuse_bad_move(clone, rev, old_pin, result, allow_downgrade)
            plans = render.selected_plans(options, templates_dir)
            render.touched(options, templates_dir)  # no templates at all is an error
            _gate_dependencies(result, clone, plans, accept_routing, progress)
            progress("rendering")
            old_read, new_read = source.reader(clone, old), source.reader(clone, new)
            rendered, result.merged_files, conflicts = render_or_merge(
                plans, old_read, new_read, options
            )
            if conflicts:
                raise MergeConflictError(
                    f"3-way merge conflicts ({'; '.join(dict.fromkeys(map(str, conflicts)))});"
                    " update those templates' anchors for the new upstream and retry"
                    " (nothing was written)"
                )
            progress(PARITY_NOTE)
            started = time.monotonic()
            gate_parity(result, rendered, parity_check, fp_parity_check, new_read)
            result.gate_s = round(time.monotonic() - started, 1)
            _write(result, root, clone, old_pin, rendered, release)
            return result


def _verdict_word(p: Parity) -> str:
    """A suite's verdict in a word or two (its summary goes to JSON)."""
    word = "passed" if p.ok else f"FAILED ({len(p.failures)} failures)"
    return word + (" (cached)" if "(cached:" in p.summary else "")


PARITY_NOTE = (
    "parity: the CPU emulator's quick suites on the new kernel headers, four toolchains"
    " (minutes the first time on a machine; a header text it has judged answers at once)"
)


def _refuse_bad_move(
    clone: Path, rev: str, old_pin: pin.Pin, result: RebaseResult, allow_downgrade: bool
) -> None:
    """Refuse a target that does not descend from the pin, or a clone that is not the pin."""
    old, new = result.old, result.new
    if not allow_downgrade and not git.is_ancestor(clone, old, new):
        older = git.is_ancestor(clone, new, old)
        raise RebaseRefused(
            f"{rev} ({new[:8]}) is {'older than' if older else 'not a descendant of'} the pin"
            f" {old[:8]}; pass --allow-downgrade to move the pin there anyway"
        )
    bad = pin.mismatches(old_pin, lambda p: git.blob_id(clone, old, p))
    if bad:
        raise BlobMismatchError(
            f"pin.toml blobs do not match {old[:8]} ({', '.join(bad)}); run `patchkit check`"
        )


def _gate_dependencies(
    result: RebaseResult,
    clone: Path,
    plans: list[render.FilePlan],
    accept_routing: bool,
    progress: source.Progress,
) -> None:
    """Mirrored functions, then routing, then anchored statements: each names what changed.

    Functions come before anchors: an anchor's block (``namespace mlx::core {``) can
    hold a mirrored function, and the refusal must name the function.
    """
    old_read = source.reader(clone, result.old)
    new_read = source.reader(clone, result.new)
    result.changed_mirrored, result.changed_called = changed_dependencies(plans, old_read, new_read)
    result.unfingerprinted = unfingerprinted(plans, old_read)
    if result.changed_mirrored:
        names = "; ".join(f"{p}: {', '.join(fs)}" for p, fs in result.changed_mirrored.items())
        raise RebaseRefused(
            f"{result.new[:8]} changes functions the streamed kernel mirrors ({names}); its"
            " M = 1 summation order may differ: update the templates to match, then retry"
        )
    gate_routing(result, clone, routing_functions(plans), accept_routing, plans)
    for name in result.unfingerprinted:
        progress(f"warning: {name} is not found at {result.old[:8]}, so not fingerprinted")
    moved = changed_anchors(plans, old_read, new_read)
    if moved:
        names = "; ".join(f"{p}: {', '.join(es)}" for p, es in moved.items())
        raise RebaseRefused(
            f"{result.new[:8]} edits upstream statements the patch is anchored to or replaces"
            f" ({names}); the patch may now shadow upstream's new rule there: review those"
            " blocks, update the templates, then retry"
        )


def unfingerprinted(plans: list[render.FilePlan], old_read: Callable[[str], str]) -> list[str]:
    """Declared mirrored/called names with no definition at the pin (a change would pass)."""
    missing = []
    for plan in plans:
        names = (*plan.mirrored, *plan.called)
        if not names:
            continue
        text = old_read(plan.path)
        for name in names:
            try:
                found = cxx.find_functions(text, name)
            except AnchorError:
                found = []
            if not found:
                missing.append(f"{plan.path}: {name}")
    return missing


def kept_release(old_pin: pin.Pin, new_blobs: dict[str, str]) -> str:
    """The old release twin when every touched file is still byte-identical to it, else none.

    A twin is a release whose touched files equal the pin's; if the new pin
    touches the same blobs, the old twin still is one. Otherwise the emulator
    reads the headers from the cached clone until ``--release`` names a new twin.
    """
    return old_pin.release if new_blobs == dict(old_pin.blobs) else ""


def _write(
    result: RebaseResult,
    root: Path,
    clone: Path,
    old_pin: pin.Pin,
    rendered: render.Rendered,
    release: str | None,
) -> None:
    """Commit, export and replace patches/ and pin.toml together."""
    new = result.new
    called = tuple(sorted({f for fs in result.changed_called.values() for f in fs}))
    routing = tuple(sorted({f for fs in result.changed_routing.values() for f in fs}))
    verdicts = [p for p in (result.parity, result.fp_parity) if p is not None]
    parity = "not run" if not verdicts else ("passed" if all(p.ok for p in verdicts) else "failed")
    bump = pin.Bump(old_pin.commit, new, pin.today(), "rebase", called, routing, parity)
    blobs = source.tree_blobs(clone, new, sorted(rendered.upstream))
    new_pin = pin.Pin(
        commit=new,
        blobs=blobs,
        url=old_pin.url,
        release=release if release is not None else kept_release(old_pin, blobs),
        history=(*old_pin.history, bump),
    )
    txn = transaction.begin_outputs(root)
    try:
        staged = txn.stage / new_pin.short
        info = export.PinInfo(new_pin.url, new, new_pin.release)
        result.head, _ = export.export_patch(clone, new, rendered, info, staged)
        drop = [root / transaction.PATCHES / old_pin.short]
        transaction.write_outputs(root, new_pin, txn, staged, drop)
    except BaseException:
        txn.abort()
        raise
    result.patches_dir = str(root / transaction.PATCHES / new_pin.short)
    result.written = True
