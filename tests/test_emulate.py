"""The patched kernels at vecs_per_tg > 1 are bit-identical to upstream's M = 1
kernels on the CPU execution path, and the harness sees a difference when there is one.

These run the real kernel source: the pinned wheel's quantized.h (hash-checked),
as upstream has it and with the patch rendered in by the templates.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from support_emulate import assert_streamed_equal_m1, mutate

from patchkit.cli import main
from patchkit.errors import BlobMismatchError, UserError
from patchkit.verify import emulate
from patchkit.verify.dispatch import STREAMED_VECS
from patchkit.verify.emulate import build, extract, parity, sanitize, suite
from patchkit.verify.emulate.families import AFFINE, DTYPES, FP

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def upstream_header() -> str:
    return emulate.pinned_header(ROOT)


@pytest.fixture(scope="module")
def patched(upstream_header: str) -> emulate.Sources:
    """The pin's quantized.h, upstream (the M = 1 reference) and patched."""
    return emulate.sources(upstream_header, AFFINE)


@pytest.fixture(scope="module", params=["gcc", "clang"])
def toolchain(request: pytest.FixtureRequest) -> build.Toolchain:
    tc = build.TOOLCHAINS[request.param]
    build.require_compiler(tc)
    return tc


# The clang default covers fewer combinations than gcc's to keep the default
# suite under a minute on two cores; `patchkit emulate --full` runs all of them.
CLANG_BITS = (3, 4, 8)


def _cases_for(toolchain: build.Toolchain) -> list[parity.Case]:
    cases = suite.default_matrix(["affine"])
    if toolchain.name == "clang":
        cases = [c for c in cases if c.bits in CLANG_BITS]
    return cases


@pytest.fixture(scope="module")
def report(patched: emulate.Sources, toolchain: build.Toolchain) -> suite.Report:
    return suite.run(patched, _cases_for(toolchain), toolchain)


def test_streamed_rows_equal_m1_bitwise(report: suite.Report) -> None:
    assert_streamed_equal_m1(report)  # rows, and every output's simd_sum inputs
    summary = suite.summarize(report)
    assert summary["sum_inputs_checked"] == sum(r.rows * r.case.N for r in report.streamed())


SUM_CASES = [
    parity.Case.affine(1024, 64, 4, 64, "float32", 5),  # qmv_fast
    parity.Case.affine(640, 37, 4, 64, "float32", 7, 2),  # qmv, moved-back tile, K tail
    parity.Case.affine(512, 5, 8, 32, "float16", 3),  # qmv, guarded rows
]
R = "result[v * results_per_simdgroup + row]"
STORE = f"{R} = simd_sum({R});"
# The guarded kernel's row sums, held in registers across the vectors' calls.
ACC = "acc[v]"
# Where the main loops add qdot, and how often: qmv_fast_impl into the result array,
# qmv_impl's two branches into the row's registers.
MAIN_LOOP_SUMS = ((R, 1), (ACC, 2))


def test_simd_sum_inputs_catch_what_one_tree_hides(patched: emulate.Sources) -> None:
    # Mutation: the patched kernels swap lane l's partial sum with lane
    # l ^ 16's before simd_sum. The shim's butterfly adds exactly those pairs
    # first, so every output keeps its bits; a tree that pairs lanes otherwise
    # would not. The input comparison must fail every output of every case.
    new = f"{R} = simd_sum(simd_shuffle_xor({R}, 16));"
    mutated = mutate(patched, STORE, new, 3)  # qmv_fast_impl, qmv_impl's two branches
    mutant = suite.run(mutated, SUM_CASES, build.TOOLCHAINS["gcc"], controls=False)
    for r in mutant.streamed():
        assert r.rows_differing == 0, r.case.label()
        assert r.sum_inputs_differing == r.sum_inputs > 0, r.case.label()
    assert len(mutant.failures()) == len(SUM_CASES)


def test_simd_sum_keys_are_confirmed_by_the_stores(patched: emulate.Sources) -> None:
    # The key of a streamed call (vector = call // rows, row = call % rows) is
    # derived from the store loop's order, and checked against the kernel's own
    # stores. Mutation: the store loops run rows outside vectors, the same
    # outputs in another call order. Keys derived for the old order no longer
    # match the stored elements, so the calls count as unconfirmed and the
    # cases fail instead of comparing the wrong outputs' inputs.
    v_loop = "for (int v = 0; v < vecs_per_tg; v++) { if (v < n_vecs) {"
    row_loop = "for (int row = 0; row < results_per_simdgroup; row++) {"
    swapped = mutate(patched, f"{v_loop} {row_loop} {STORE}", f"{row_loop} {v_loop} {STORE}", 2)
    mutant = suite.run(swapped, SUM_CASES[:1], build.TOOLCHAINS["gcc"], controls=False)
    (r,) = mutant.streamed()
    assert r.rows_differing == 0 and r.sum_calls_unconfirmed > 0


def test_matrix_reaches_every_m1_path_and_tile(report: suite.Report) -> None:
    ran = {(r.m1_kernel, r.V, r.case.B > 1, r.case.dtype) for r in report.streamed()}
    for m1, V, batched, dtype in itertools.product(
        ("qmv_fast", "qmv"),  # both M = 1 kernels
        STREAMED_VECS,  # every instantiated tile size
        (False,),  # unbatched everywhere; batched is checked below
        DTYPES,
    ):
        assert (m1, V, batched, dtype) in ran
    assert any(r.case.B > 1 and r.m1_kernel == "qmv" for r in report.streamed())
    assert any(r.case.B > 1 and r.m1_kernel == "qmv_fast" for r in report.streamed())


def test_negative_control_qmv_wide_diverges(report: suite.Report) -> None:
    # Measured on the default matrix: 100% of float32 cases differ, 90% (g++)
    # and 82% (clang) of float16 ones; bf16's short mantissa hides more.
    assert report.control_divergence(("float32",)) >= 0.95
    assert report.control_divergence(("float16",)) >= 0.75
    assert report.control_divergence() >= AFFINE.min_control


def test_harness_catches_a_reordered_streamed_kernel(patched: emulate.Sources) -> None:
    # Mutation: the patched kernels add qdot's bias term to the row's sum
    # before the scaled dot product, the same value in exact arithmetic,
    # rounded in another order. A harness that cannot see this could not prove
    # identity.
    x = "x_thread + v * values_per_thread"
    mutated = patched
    for into, count in MAIN_LOOP_SUMS:
        call = f"{into} += qdot<U, values_per_thread, bits>(wl, {x}, s, b, sum[v]);"
        reordered = (
            f"{into} = ({into} + sum[v] * b)"
            f" + qdot<U, values_per_thread, bits>(wl, {x}, s, U(0), U(0));"
        )
        mutated = mutate(mutated, call, reordered, count)
    cases = [
        parity.Case.affine(1024, 64, 4, 64, "float32", 5),
        parity.Case.affine(640, 37, 4, 64, "float32", 7),
    ]
    mutant = suite.run(mutated, cases, build.TOOLCHAINS["gcc"], controls=False)
    assert not mutant.streamed_identical
    assert len(mutant.failures()) == len(cases)


def test_long_k_shapes_see_a_reassociated_tail(patched: emulate.Sources) -> None:
    # Mutation: the patched qmv_impl adds its K tail together with the first
    # block's contribution, (R - b0) + (t + b0) instead of R + t. With one main
    # block (K = 512, 4-bit: R = b0) that is 0 + (t + b0), the same bits, so the
    # K = 512 shapes cannot see it; the long-K shapes (4 blocks before the tail)
    # must.
    x = "x_thread + v * values_per_thread"
    first = "first[v * results_per_simdgroup + row]"
    decl = "thread U result[vecs_per_tg * results_per_simdgroup] = {0};"
    mutated = mutate(patched, decl, decl + " thread U first[vecs_per_tg * 4] = {};", 2)
    for into, count in MAIN_LOOP_SUMS:
        mutated = mutate(
            mutated,
            f"{into} += qdot<U, values_per_thread, bits>(wl, {x}, s, b, sum[v]);",
            f"{{ U q = qdot<U, values_per_thread, bits>(wl, {x}, s, b, sum[v]);"
            f" if (k == 0) {first} = q; {into} += q; }}",
            count,
        )
    mutated = mutate(
        mutated,
        f"{ACC} += qdot_safe<U, values_per_thread, bits>(wl, {x}, s, b, sum[v], tail);",
        f"{ACC} = ({ACC} - {first}) + (qdot_safe<U, values_per_thread, bits>"
        f"(wl, {x}, s, b, sum[v], tail) + {first});",
        2,
    )
    short = [suite.AFFINE_SHAPES["n_lt_8"], suite.AFFINE_SHAPES["n_not_mult_8"]]
    cases = [
        parity.Case.affine(K, N, 4, 64, "float32", 6, 3)
        for K, N in [*short, *suite.LONG_K_SHAPES.values()]
    ]
    mutant = suite.run(mutated, cases, build.TOOLCHAINS["gcc"], controls=False)
    failed = {(r.case.K, r.case.N) for r in mutant.streamed() if not r.identical}
    assert failed == set(suite.LONG_K_SHAPES.values())


def test_unwritten_rows_cannot_pass() -> None:
    # Outputs start as NaN/all-ones: a kernel that writes nothing must differ.
    case = parity.Case.affine(512, 16, 4, 64, "float16", 2)
    written = np.zeros((1, 2, 16), dtype=np.float16)
    untouched = parity._empty_out(case, 2, 1, written)
    result = parity.compare(case, "x", parity.Output(written), parity.Output(untouched))
    assert result.rows_differing == 2


def test_clang_build_fuses_and_gcc_build_does_not(patched: emulate.Sources) -> None:
    # The two toolchains exist to cover both contraction behaviours; check
    # they really produce different instruction mixes on x86-64.
    if subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout.strip() != "x86_64":
        pytest.skip("the FMA instruction check is written for x86-64")
    src = extract.extract(patched, AFFINE.upstream_kernels + AFFINE.streamed_kernels)
    counts = {}
    for name in ("gcc", "clang"):
        build.require_compiler(build.TOOLCHAINS[name])
        lib = build.build(src, [("float32", 64, 4)], build.TOOLCHAINS[name])
        asm = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True).stdout
        counts[name] = len(re.findall(r"\bvfn?m(add|sub)\d+[sp]s\b", asm))
    assert counts["gcc"] == 0
    assert counts["clang"] > 0


@pytest.mark.parametrize(
    "edge",
    # zero, one, the largest half, just below and at the overflow threshold,
    # subnormals around the smallest half, ties, ordinary values
    [[0.0, -0.0, 1.0], [65504.0, 65519.0, 65520.0], [6.0e-8, 2.9e-8, 3.0e-8, 1e-5], [0.1, -1234.5]],
)
def test_shim_half_rounding_matches_numpy(edge: list[float]) -> None:
    # Narrow types round like IEEE binary16: the shim's float -> half must
    # agree with numpy bit for bit, on edges and on random values.
    rng = np.random.default_rng(1)
    sample = np.concatenate([edge, rng.standard_normal(256) * 10.0 ** rng.integers(-7, 5, 256)])
    sample = sample.astype(np.float32)
    with np.errstate(over="ignore"):
        expected = sample.astype(np.float16).view(np.uint16)
    assert np.array_equal(_shim_half(sample).view(np.uint16), expected)


def _shim_half(values: np.ndarray) -> np.ndarray:
    """Convert float32 values with the shim's half type via a tiny C++ program."""
    src = (
        '#include "metal_shim.h"\nint main() {\n  float f;\n'
        "  while (std::fread(&f, 4, 1, stdin) == 1) {\n"
        "    half h = f;\n    std::fwrite(&h, 2, 1, stdout);\n  }\n}\n"
    )
    shim = (build.HERE / "metal_shim.h").read_bytes()
    exe = build.cache_dir() / f"half-{hashlib.sha256(shim + src.encode()).hexdigest()[:16]}"
    if not exe.exists():
        exe.parent.mkdir(parents=True, exist_ok=True)
        cpp = exe.with_suffix(".cpp")
        cpp.write_text(src)
        cmd = ["g++", "-std=c++20", f"-I{build.HERE}", str(cpp), "-o", str(exe)]
        subprocess.run(cmd, check=True)
    out = subprocess.run([str(exe)], input=values.tobytes(), capture_output=True, check=True).stdout
    return np.frombuffer(out, dtype=np.float16)


def test_pinned_header_refuses_a_different_blob(tmp_path: Path, upstream_header: str) -> None:
    other = tmp_path / "quantized.h"
    other.write_text(upstream_header + "\n// not the pin\n")
    with pytest.raises(BlobMismatchError, match=r"pin\.toml records f628c056"):
        emulate.pinned_header(ROOT, other)


def test_extraction_names_a_missing_function(upstream_header: str) -> None:
    # A patched text without qmv_fast_impl (an upstream that renamed it).
    renamed = upstream_header.replace("qmv_fast_impl", "qmv_fast_body")
    with pytest.raises(UserError, match=r"patched affine kernel header has no 'qmv_fast_impl'"):
        extract.extract(emulate.Sources(upstream_header, renamed), ("qmv_fast_streamed",))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bits", "7"], "unsupported --bits 7"),
        (["--group-size", "48"], "unsupported --group-size 48"),
        (["-K", "100"], "not a multiple of --group-size"),
    ],
)
def test_cli_rejects_bad_input_in_one_line(args: list[str], message: str) -> None:
    base = ["patchkit", "emulate", "--kernel", "streamed", "-K", "512", "-N", "8"]
    proc = subprocess.run(base + args, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_missing_compiler_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # In-process, so the toolchain table can name a compiler that does not exist.
    monkeypatch.setitem(build.TOOLCHAINS, "gcc", build.Toolchain("gcc", "g++-not-installed", ()))
    monkeypatch.chdir(ROOT)
    args = ["emulate", "--kernel", "streamed", "-K", "512", "-N", "64", "-M", "3"]
    r = CliRunner().invoke(main, [*args, "--toolchain", "gcc", "--json"])
    assert r.exit_code == 1, r.output
    assert "g++-not-installed not found" in r.stderr and "--toolchain" in r.stderr
    assert "Traceback" not in r.output
    error = json.loads(r.stdout)  # under --json the error is one JSON object
    assert error["ok"] is False and error["kind"] == "UserError" and error["exit"] == 1


def test_cli_one_case_json_has_rows_and_rows_differing() -> None:
    cmd = ["patchkit", "emulate", "--kernel", "streamed", "-K", "2048", "-N", "96"]
    cmd += [
        "--bits",
        "4",
        "--group-size",
        "64",
        "--dtype",
        "float16",
        "-M",
        "6",
        "-B",
        "1",
        "--json",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    import json

    data = json.loads(proc.stdout)
    assert data["rows"] == 6 and data["rows_differing"] == 0 and data["identical"] is True


def test_two_dim_batches_equal_m1(patched: emulate.Sources) -> None:
    # The kernels' elem_to_loc / elem_to_loc_broadcast path (batch ndims 2),
    # own weights per batch and weights shared along each dimension. The M = 1
    # reference picks each batch's weights in Python (Case.w_index), not
    # through the shim, so wrong offsets there show as differing rows.
    cases = [c for c in suite.multi_batch_cases(("affine",)) if c.dtype == "float32"]
    cases = [c for c in cases if c.M == 7]
    report = suite.run(patched, cases, build.TOOLCHAINS["gcc"])
    assert {(c.batch, c.w_shared) for c in cases} == set(suite.MULTI_BATCHES)
    assert report.failures() == []
    assert sum(r.rows for r in report.streamed()) == len(cases) * 6 * 7
    assert report.control_divergence() >= AFFINE.min_control


@pytest.mark.wide
def test_two_dim_batches_every_build(patched: emulate.Sources, toolchain: build.Toolchain) -> None:
    cases = suite.multi_batch_cases(("affine",))
    for name in (toolchain.name, toolchain.name + "-fast"):
        report = suite.run(patched, cases, build.TOOLCHAINS[name])
        assert report.failures() == [], name
        assert report.control_divergence() >= AFFINE.min_control, name


def _patched_text(header: str) -> str:
    family = AFFINE if header == "affine" else FP
    return emulate.sources(emulate.pinned_sources(ROOT, family)[0], family).patched


@pytest.mark.wide
@pytest.mark.parametrize("header", ["affine", "fp"])
def test_sanitizer_build_reports_nothing(header: str) -> None:
    # ASan + UBSan over partial tiles, N < 8, K tails, B 3 and (2, 3) batches;
    # fp: every mode, nvfp4's global-scale and r_2 variants (sanitize.cases).
    proc = sanitize.run_child(header)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "ERROR: AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr
    ran = sanitize.cases(header)
    rows = sum(c.B * c.M for c in ran)
    assert f"streamed {len(ran)} cases, 0 differing" in proc.stdout, proc.stdout
    assert f"rows {rows}, differing 0" in proc.stdout, proc.stdout


@pytest.mark.wide
@pytest.mark.parametrize("header", ["affine", "fp"])
def test_sanitizer_build_fails_an_out_of_bounds_read(header: str, tmp_path: Path) -> None:
    # Mutation: the patched qmv_fast_impl loads the vectors of a partial last
    # tile past M, reading the rows after x's last one. Those rows' results
    # are never stored, so output parity cannot see it; ASan must.
    skip = "for (int v = 0; v < vecs_per_tg && v < n_vecs; v++) {"
    load = ("sum[v] = " if header == "affine" else "") + "load_vector<T, U, values_per_thread"
    every = "for (int v = 0; v < vecs_per_tg; v++) {"
    src = emulate.Sources("", _patched_text(header))
    wide_open = mutate(src, f"{skip} {load}", f"{every} {load}", 3)
    mutated = tmp_path / "header.h"
    mutated.write_text(wide_open.patched)
    proc = sanitize.run_child(header, mutated)
    assert proc.returncode == sanitize.REPORTED, proc.stdout + proc.stderr[-2000:]
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in proc.stderr
    assert "READ of size" in proc.stderr and "patched" in proc.stderr


@pytest.mark.wide
def test_full_matrix(patched: emulate.Sources, toolchain: build.Toolchain) -> None:
    full = suite.run(patched, suite.full_matrix(["affine"]), toolchain)
    assert full.failures() == []
    assert full.control_divergence() >= AFFINE.min_control


def test_address_space_check_passes_the_patched_kernels(patched: emulate.Sources) -> None:
    # device/constant/threadgroup as clang address spaces 1/2/3: upstream's
    # and our affine kernels compile, as they must for Metal's compiler.
    build.require_compiler(build.TOOLCHAINS["clang"])
    src = extract.extract(patched, AFFINE.upstream_kernels + AFFINE.streamed_kernels)
    build.check_address_spaces(src, [(d, 64, 4) for d in DTYPES])


def test_address_space_check_refuses_a_thread_pointer_as_device(patched: emulate.Sources) -> None:
    # Mutation: the patched kernel hands qdot a thread pointer (x_thread) where
    # it takes the device pointer to the packed weights. The shim without
    # address spaces would compile and run this; the check names the line.
    build.require_compiler(build.TOOLCHAINS["clang"])
    call = "qdot<U, values_per_thread, bits>(wl, x_thread + v * values_per_thread, s, b, sum[v])"
    bad = "qdot<U, values_per_thread, bits>((thread uint8_t*)x_thread, x_thread, s, b, sum[v])"
    mutated = mutate(patched, call, bad, 3)
    src = extract.extract(mutated, AFFINE.upstream_kernels + AFFINE.streamed_kernels)
    with pytest.raises(UserError, match=r"address-space check failed") as err:
        build.check_address_spaces(src, [("float16", 64, 4)])
    assert "(thread uint8_t*)x_thread" in str(err.value)
