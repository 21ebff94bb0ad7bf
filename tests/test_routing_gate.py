"""The rebase gate covers routing: drift in the functions that pick a shape's kernel stops it.

A scratch upstream holds the pin's real routing sources (Metal ``quantized.cpp``,
CUDA ``quantized.cpp``, ``qmm.cu``, ``qmv.cu``) and ``quantized.h``, read from a full
MLX clone; each test adds one synthetic upstream commit, the kinds a fault battery
found merged silently, and rebases onto it. Small templates stand in for the real
ones (which are rewritten often): one insertion per file at the real anchors, and
``routing`` lists as the real ``edits.toml`` files declare them.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from support_git import PIN_SHA, QH, isolate_cache, mlx_clone, write_templates

from patchkit import cli
from patchkit.carry import apply, pin, rebase, render
from patchkit.util import git

pytest_plugins = ("support_git",)
DATE = "2026-08-21T00:00:00+00:00"
METAL = "mlx/backend/metal/quantized.cpp"
CUDA = "mlx/backend/cuda/quantized/quantized.cpp"
QMM = "mlx/backend/cuda/quantized/qmm/qmm.cu"
QMV = "mlx/backend/cuda/quantized/qmm/qmv.cu"
METAL_ROUTE = "if (M >= 2 && use_qmv_wide(mode, d) && !global_scale) {"

TEMPLATES = {
    METAL: f"""\
backend = "metal"
[depends]
mirrored = ["qmv_fast_k_alignment"]
routing = ["dispatch_qmv", "use_qmv_wide", "get_qmv_batch_limit", "qmv",
           "QuantizedMatmul::eval_gpu", "add_strides_and_shapes"]
[[edit]]
op = "before_statement"
anchor = "{METAL_ROUTE}"
template = "route.j2"
""",
    CUDA: f"""\
backend = "cuda"
[depends]
routing = ["QuantizedMatmul::eval_gpu", "GatherQMM::eval_gpu",
           {{ function = "supports_qmv", path = "{QMM}" }}]
[[edit]]
op = "before_statement"
anchor = "if (can_use_qmm_sm90) {{"
template = "route.j2"
""",
    QMV: """\
backend = "cuda"
[depends]
mirrored = ["qmv_kernel_impl"]
routing = ["qmv", "dispatch_quant_types", "dispatch_groups"]
[[edit]]
op = "before_statement"
anchor = "namespace mlx::core {"
template = "route.j2"
""",
}


class ParityStub:
    def __init__(self, ok: bool) -> None:
        self.ok, self.calls = ok, 0

    def __call__(self, *headers: str) -> rebase.Parity:
        self.calls += 1
        return rebase.Parity(self.ok, "stub", () if self.ok else ("qmv M=3 row 1 differs",))


@pytest.fixture
def scratch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Upstream at the pin (its routing files and quantized.h), applied in a project."""
    spec = mlx_clone()
    if spec is None:
        pytest.skip("needs a full MLX clone with 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx")
    mirror = Path(spec)
    repo = tmp_path / "upstream"
    git.init(repo)
    for path in (METAL, CUDA, QMM, QMV, QH):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        text = git.show_file(mirror, PIN_SHA, path)
        (repo / path).write_bytes(text.encode("utf-8", "surrogateescape"))
    git.run(repo, "add", "--all")
    pinned = git.commit(repo, "upstream at the pin", date=DATE, author=("MLX", "m@example.com"))
    templates = write_templates(tmp_path)  # quantized.h: a derived copy of qmv_impl
    for path, edits in TEMPLATES.items():
        d = templates / path
        d.mkdir(parents=True)
        (d / "edits.toml").write_text(edits)
        (d / "route.j2").write_text("  // patchkit route ({{ flavour }})\n")
    isolate_cache(monkeypatch, tmp_path / "cache")
    monkeypatch.setenv("PATCHKIT_MLX_REPO", str(repo))
    root = tmp_path / "project"
    root.mkdir()
    apply.apply(pinned, root=root, templates_dir=templates)
    return {"repo": repo, "pin": pinned, "root": root, "templates": templates}


def upstream_commit(s: dict, path: str, edit: Callable[[str], str], name: str) -> str:
    """One synthetic upstream commit on top of the pin that rewrites ``path``."""
    repo = s["repo"]
    git.run(repo, "checkout", "--quiet", "-B", name, s["pin"])
    text = (repo / path).read_text()
    changed = edit(text)
    assert changed != text, f"{name}: the edit did not apply"
    (repo / path).write_text(changed)
    git.add(repo, [path])
    return git.commit(repo, f"upstream: {name}", date=DATE, author=("MLX", "m@example.com"))


def outputs(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def do_rebase(s: dict, rev: str, parity: ParityStub | None = None, **kw: object):
    return rebase.rebase(
        rev,
        root=s["root"],
        templates_dir=s["templates"],
        parity_check=parity or ParityStub(True),
        fp_parity_check=None,
        **kw,
    )


def narrowed_metal_condition(text: str) -> str:
    return text.replace(METAL_ROUTE, METAL_ROUTE.replace("M >= 2 &&", "M >= 2 && M <= 8 &&"))


def branch_before_metal_routing(text: str) -> str:
    new_branch = (
        '  if (M >= 2 && M <= 4 && mode == "affine" && d.get_architecture_gen() >= 16) {\n'
        "    qmm_splitk(x, w, scales, biases, out, group_size, bits, M, N, K, d, s, mode);\n"
        "    return;\n"
        "  }\n\n"
    )
    anchor = "  // Small batch so route to qmv_wide"
    return text.replace(anchor, new_branch + anchor, 1)


def condition_in_cuda_supports_qmv(text: str) -> str:
    start = text.index("bool supports_qmv(")
    at = text.index("  int k = x.shape(-1);\n", start) + len("  int k = x.shape(-1);\n")
    return text[:at] + "  if (x.shape(-2) == 1 && k > 8192) {\n    return false;\n  }\n" + text[at:]


def _guard(condition: str, value: str) -> str:
    """An early return, as upstream would write one."""
    return f"  if ({condition}) {{\n    return{' ' + value if value else ''};\n  }}\n"


def _first_line_of(function: str, added: str) -> Callable[[str], str]:
    """An upstream edit: ``added`` as the first statement of ``function``'s body."""

    def edit(text: str) -> str:
        at = text.index("{\n", text.index(function)) + 2
        return text[:at] + added + text[at:]

    return edit


# The fault battery's probes: (file, edit, the function the refusal names). The first three
# and the batch-dims one touch declared routing functions; the other three only the route
# found from the source.
PROBES = {
    "narrowed-metal-condition": (METAL, narrowed_metal_condition, f"{METAL}: dispatch_qmv"),
    "branch-before-metal-routing": (METAL, branch_before_metal_routing, f"{METAL}: dispatch_qmv"),
    "condition-in-cuda-supports_qmv": (QMM, condition_in_cuda_supports_qmv, f"{QMM}: supports_qmv"),
    "condition-in-cuda-supports_fp_qmv": (
        QMM,
        _first_line_of(
            "bool supports_fp_qmv(", "  if (x.shape(-1) > 8192) {\n    return false;\n  }\n"
        ),
        f"{QMM}: supports_fp_qmv",
    ),
    "cuda-sm90-support-depends-on-M": (
        QMM,
        _first_line_of(
            "bool supports_qmm_sm90(", "  if (x.shape(-2) < 8) {\n    return false;\n  }\n"
        ),
        f"{QMM}: supports_qmm_sm90",
    ),
    # The batched kernels read M as x_shape[x_batch_ndims], which this writes for B > 1.
    "metal-batch-dims-collapsed": (
        METAL,
        _first_line_of(
            "inline int add_strides_and_shapes(", "  if (x.ndim() > 3) {\n    return offset;\n  }\n"
        ),
        f"{METAL}: add_strides_and_shapes",
    ),
    "early-branch-in-metal-qqmatmul": (
        METAL,
        _first_line_of(
            "void QQMatmul::eval_gpu(", "  if (inputs.size() > 8) {\n    return;\n  }\n"
        ),
        f"{METAL}: QQMatmul::eval_gpu",
    ),
}


@pytest.mark.parametrize("probe", list(PROBES))
def test_routing_drift_stops_the_rebase_with_the_function_and_diff(
    scratch: dict, probe: str
) -> None:
    path, edit, named = PROBES[probe]
    new = upstream_commit(scratch, path, edit, probe)
    before = outputs(scratch["root"])
    parity = ParityStub(True)
    with pytest.raises(rebase.RoutingChanged) as caught:
        do_rebase(scratch, new, parity)
    exc = caught.value
    assert named in str(exc) and "--accept-routing-change" in str(exc)
    assert "\n" not in str(exc)  # one line; the diff rides along as details
    added = [ln for ln in exc.details.splitlines() if ln.startswith("+") and "@" not in ln]
    assert added, exc.details
    assert all(ln[1:] in edit(git.show_file(scratch["repo"], scratch["pin"], path)) for ln in added)
    assert outputs(scratch["root"]) == before and parity.calls == 0  # nothing written or run


def test_accepting_a_routing_change_runs_parity_and_records_it(scratch: dict) -> None:
    new = upstream_commit(scratch, METAL, branch_before_metal_routing, "accepted")
    with pytest.raises(rebase.RebaseRefused, match="parity fails"):  # control: parity gates
        do_rebase(scratch, new, ParityStub(False), accept_routing=True)
    parity = ParityStub(True)
    r = do_rebase(scratch, new, parity, accept_routing=True)
    assert r.written and parity.calls == 1 and r.changed_routing == {METAL: ["dispatch_qmv"]}
    p = pin.load(scratch["root"] / "pin.toml")
    assert p.commit == new and any("dispatch_qmv" in f for f in p.history[-1].routing)
    assert set(r.routing) >= {f"{METAL}: dispatch_qmv", f"{QMM}: supports_qmv"}


def test_unrelated_upstream_change_passes_the_gate(scratch: dict) -> None:
    """Control: qvm (no route of ours) changes; the rebase goes through without a flag."""

    def touch_qvm(text: str) -> str:
        return text.replace("void qvm(", "// upstream tweak\nvoid qvm(", 1)

    new = upstream_commit(scratch, METAL, touch_qvm, "unrelated")
    r = do_rebase(scratch, new)
    assert r.written and r.changed_routing == {}


def test_mirrored_change_is_named_by_function_not_by_anchor(scratch: dict) -> None:
    """A changed sum order in qmv_kernel_impl, inside the anchored ``namespace mlx::core {``."""

    def reorder(text: str) -> str:
        start = text.index("qmv_kernel_impl(")
        brace = text.index("{\n", start) + 2
        return text[:brace] + "  // sums reversed upstream\n" + text[brace:]

    new = upstream_commit(scratch, QMV, reorder, "reordered")
    with pytest.raises(rebase.RebaseRefused) as caught:
        do_rebase(scratch, new, accept_routing=True)
    assert f"{QMV}: qmv_kernel_impl" in str(caught.value)
    assert "namespace mlx::core" not in str(caught.value)


def test_cli_shows_the_diff_after_one_line_and_in_json(scratch: dict) -> None:
    new = upstream_commit(scratch, QMM, condition_in_cuda_supports_qmv, "cli")
    args = ["rebase", "--to", new, "--root", str(scratch["root"])]
    args += ["--templates", str(scratch["templates"])]
    res = CliRunner().invoke(cli.main, args)
    assert res.exit_code == 1
    err = [ln for ln in res.stderr.splitlines() if not ln.endswith("…")]  # no progress lines
    assert err[0].startswith("patchkit: error:") and "supports_qmv" in err[0]
    assert "+  if (x.shape(-2) == 1 && k > 8192) {" in err[1:]
    res = CliRunner().invoke(cli.main, [*args, "--json"])
    payload = json.loads(res.stdout)
    assert payload["kind"] == "RoutingChanged" and "k > 8192" in payload["details"]


def test_every_routing_function_of_the_real_templates_is_found_at_the_pin() -> None:
    """The real ``edits.toml`` files' ``routing`` lists: each function fingerprinted at the pin."""
    spec = mlx_clone()
    if spec is None:
        pytest.skip("needs a full MLX clone with 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx")
    manifests = sorted(render.TEMPLATES_DIR.rglob(render.MANIFEST))
    declared = {
        m: tomllib.loads(m.read_text()).get("depends", {}).get("routing", []) for m in manifests
    }
    declared = {m: r for m, r in declared.items() if r}
    assert len(declared) >= 3, declared  # Metal quantized.cpp, CUDA quantized.cpp, qmv.cu
    fns = rebase.routing_functions(render.load_plans())
    names = {f.name for f in fns}
    assert {"dispatch_qmv", "use_qmv_wide", "get_qmv_batch_limit", "supports_qmv"} <= names
    assert any(re.fullmatch(r"\w+::eval_gpu", n) for n in names)
    prints, changed, missing = rebase.changed_routing(fns, Path(spec), PIN_SHA, PIN_SHA)
    assert missing == [] and changed == {} and len(prints) == len(fns)


def test_a_new_caller_of_the_dispatch_in_a_new_file_stops_the_rebase(scratch: dict) -> None:
    """Upstream adds a primitive whose eval_gpu calls the patched dispatch, in a file no
    manifest names: the route derived from the source picks it up as new on the route."""
    repo = scratch["repo"]
    git.run(repo, "checkout", "--quiet", "-B", "new-caller", scratch["pin"])
    extra = "mlx/backend/metal/quantized_speculative.cpp"
    (repo / extra).write_text(
        "namespace mlx::core {\n\n"
        "void SpeculativeQMV::eval_gpu(const std::vector<array>& inputs, array& out) {\n"
        "  dispatch_qmv(inputs[0], inputs[1], out);\n}\n\n}  // namespace mlx::core\n"
    )
    git.add(repo, [extra])
    new = git.commit(repo, "upstream: a new caller", date=DATE, author=("MLX", "m@example.com"))
    with pytest.raises(rebase.RoutingChanged) as caught:
        do_rebase(scratch, new)
    assert f"{extra}: SpeculativeQMV::eval_gpu" in str(caught.value)
    assert "now on the route to the patched kernels" in caught.value.details


def test_the_route_derived_at_the_pin_covers_the_declared_and_the_missed() -> None:
    """At the real pin, from the real templates: the derived route holds what the fault
    battery found the hand-written lists missed, and every declared function it can reach."""
    spec = mlx_clone()
    if spec is None:
        pytest.skip("needs a full MLX clone with 9a795735: set PATCHKIT_MLX_REPO=/path/to/mlx")
    found = set(rebase.derived_routing(Path(spec), PIN_SHA, render.load_plans()))
    for key in [
        (METAL, "QQMatmul::eval_gpu"), (METAL, "QuantizedMatmul::eval_gpu"),
        (METAL, "dispatch_qmv"), (METAL, "qmv_fast_k_alignment"), (METAL, "get_qmv_batch_limit"),
        (METAL, "add_strides_and_shapes"),
        (QMM, "supports_fp_qmv"), (QMM, "supports_qmm_sm90"), (QMM, "supports_qmv"),
        (CUDA, "QuantizedMatmul::eval_gpu"), (QMV, "qmv"),
        ("mlx/backend/cuda/quantized/qqmm.cpp", "QQMatmul::eval_gpu"),
    ]:  # fmt: skip
        assert key in found, key
    # gather_qmv is upstream's, untouched: GatherQMM's route does not reach the change
    assert (CUDA, "GatherQMM::eval_gpu") not in found
    # control: a primitive with no route to the patched kernels is not gated
    assert not any(name.startswith(("Softmax", "Matmul::")) for _, name in found)
