"""`patchkit probe` on the CPU: block vs chain on the tiny decoder, with a negative control.

Stock MLX on the CPU is reported whatever it shows (the assertions on it are
about the probe's bookkeeping, not about MLX); the ``reordered`` arm proves the
byte comparison and the per-op isolation can fail; the streamed arm must be
reported as unavailable on the CPU, never silently faked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from patchkit.cli import main
from patchkit.errors import UserError
from patchkit.verify.probe import Options, exact, linears, report, run, speed

mx = pytest.importorskip("mlx.core", reason="mlx not installed: pip install -e '.[mlx]'")

LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"}


@pytest.fixture(scope="module")
def payload() -> dict[str, Any]:
    """One small run shared by the tests: both widths, stock + control + streamed (skipped).

    T = 2 (smallest block), 8 (where CUDA's stock routing leaves qmv) and 16 (the limit).
    """
    if mx.default_device() != mx.cpu:
        pytest.skip("the CPU test of the probe; on a GPU run `patchkit probe` itself")
    opts = Options(bits=(4, 8), arms=("stock", "streamed", "reordered"), ts=(2, 8, 16))
    return run(opts)


def _result(payload: dict[str, Any], bits: int, arm: str) -> dict[str, Any]:
    return next(r for r in payload["results"] if r["bits"] == bits and r["arm"] == arm)


def test_streamed_arm_is_reported_unavailable_on_cpu(payload: dict[str, Any]) -> None:
    assert payload["arms_run"] == ["stock", "reordered"]
    assert "CPU backend" in payload["arms_skipped"]["streamed"]


def test_streamed_arm_on_cuda_says_to_probe_a_patched_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA there is no kernel to JIT (the change is MLX's compiled qmv): the streamed arm
    is refused with the way to probe the change, the other arms still run."""
    monkeypatch.setattr(linears, "backend", lambda: "cuda")
    avail = linears.availability()
    assert avail["stock"] is None and avail[linears.CONTROL] is None
    assert "patchkit build --backend cuda" in avail["streamed"]
    with pytest.raises(UserError, match="patched build"):
        linears.make("streamed", Path("."))


@pytest.mark.parametrize("bits", [4, 8])
def test_stock_cpu_verdicts_are_consistent(payload: dict[str, Any], bits: int) -> None:
    """Whatever stock CPU MLX shows, each verdict agrees with its own counts and greedy tokens."""
    res = _result(payload, bits, "stock")
    assert [v["T"] for v in res["per_T"]] == [2, 8, 16]
    for v in res["per_T"]:
        assert v["start_state_block"] == v["start_state_chain"]  # one start state
        assert (v["first_differing_position"] is None) == v["identical"]
        assert len(v["greedy_block"]) == len(v["greedy_chain"]) == v["T"]
        if v["identical"]:
            assert v["greedy_block"] == v["greedy_chain"]
            assert v["max_abs_diff"] == 0.0
    assert set(res["per_op"][2]) >= LINEARS | {"attention", "rope_q", "attn_norm", "swiglu"}


@pytest.mark.parametrize("bits", [4, 8])
def test_control_arm_differs_and_per_op_blames_the_linears(
    payload: dict[str, Any], bits: int
) -> None:
    """Negative control: an order change in M >= 2 linears must fail the probe, op by op."""
    res = _result(payload, bits, "reordered")
    s = res["summary"]
    assert s["identical_all_T"] is False and s["T_differing"] == [2, 8, 16]
    assert s["linears_identical_all_T"] is False
    assert set(s["ops_differing_at_T"]) == LINEARS  # norms, rope, attention not blamed
    first = res["per_T"][0]
    assert first["differing_logits"] > 0 and first["first_differing_position"] == 0
    assert first["start_state_block"] == first["start_state_chain"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_compare_counts_bit_differences_not_value_differences(dtype: str) -> None:
    """One ulp and a signed zero differ; the verdict's count and first row come from bits."""
    block = mx.zeros((4, 6)).astype(getattr(mx, dtype))
    chain = mx.array(block)
    chain[1, 3] = -0.0  # equal as a value, different bytes
    block[3, 0] = 1.0
    chain[3, 0] = mx.array(1.0, dtype=block.dtype) + mx.finfo(block.dtype).eps  # 1 ulp above
    n, first, mad = exact.compare(block, chain)
    assert (n, first) == (2, 1)
    assert mad == pytest.approx(float(mx.finfo(block.dtype).eps))
    assert exact.compare(block, mx.array(block)) == (0, None, 0.0)


def test_markdown_and_json_written(payload: dict[str, Any], tmp_path: Path) -> None:
    written = report.write(payload, tmp_path / "probe.json", "patchkit probe --size tiny")
    md = written[1].read_text()
    assert "## 4-bit, stock" in md and "## 8-bit, reordered" in md
    assert "| T | identical |" in md and "patchkit probe --size tiny" in md
    assert json.loads(written[0].read_text())["arms_run"] == ["stock", "reordered"]


def test_expected_tokens_formula() -> None:
    assert speed.expected_tokens(1, 0.7) == pytest.approx(1.0)
    assert speed.expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25)
    assert speed.expected_tokens(5, 1.0) == 5.0
    times = {1: {"block_s": 0.01, "chain_s": 0.01}, 4: {"block_s": 0.02, "chain_s": 0.04}}
    th = speed.throughput(times, 0.5)
    assert th["plain_decode_tok_s"] == pytest.approx(100.0)
    assert th["per_T"][4]["block_tok_s"] == pytest.approx(1.875 / 0.02)
    assert th["best_T_block"] == 4


@pytest.mark.parametrize(
    "opts",
    [
        Options(size="7b"),
        Options(bits=(3,)),
        Options(ts=(1, 2)),
        Options(ts=(17,)),
        Options(attention="flash"),
    ],
)
def test_bad_options_are_user_errors(opts: Options) -> None:
    with pytest.raises(UserError):
        opts.validate()


def test_cli_probe_json_with_timing() -> None:
    """The thin command: smallest T, timing on (CPU times are recorded, not judged)."""
    if mx.default_device() != mx.cpu:
        pytest.skip("CPU-only CLI check")
    args = [
        "probe",
        "--bits",
        "4",
        "--max-t",
        "2",
        "--arm",
        "stock",
        "--no-per-op",
        "--timing",
        "--json",
    ]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    res = out["results"][0]
    assert res["per_T"][0]["T"] == 2 and "throughput" in res
    assert res["throughput"]["plain_decode_tok_s"] > 0


def test_cli_rejects_bad_max_t() -> None:
    r = CliRunner().invoke(main, ["probe", "--max-t", "40"])
    assert r.exit_code == 1 and "2..16" in r.output


def test_per_query_attention_runs_the_chains_calls() -> None:
    """The per-query block attention is recorded, checked per op, and changes no linear."""
    if mx.default_device() != mx.cpu:
        pytest.skip("CPU-only check")
    opts = Options(bits=(4,), arms=("stock", "reordered"), ts=(4,), attention="per_query")
    p = run(opts)
    assert p["attention"] == "per_query"
    stock, control = p["results"]
    assert stock["per_op"][4]["attention"]["rows_differing"] == 0
    assert set(control["summary"]["ops_differing_at_T"]) == LINEARS
