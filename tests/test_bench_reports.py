"""The two CUDA benchmarks' reports, from records shaped as their runs write them.

No GPU: the records are small and synthetic, so each number in a table can be checked
against the arithmetic it stands for (ratio to stock, floor over time, rows checked).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support_scripts import load_script

from patchkit.verify.harness import cuda

ROOT = Path(__file__).resolve().parent.parent


def _mlx_qmv_report(stock_us: float, pr_us: float, nbytes: int, copy: float) -> dict:
    return {
        "dtype": "bfloat16",
        "group_size": 64,
        "copy_bytes_per_s": copy,
        "rows": [
            {
                "K": 4096, "N": 4096, "bits": 4, "M": 1, "bytes": nbytes,
                "stock_us": stock_us, "pr_us": pr_us, "floor_us": nbytes / copy * 1e6,
            }
        ],
    }  # fmt: skip


def test_mlx_qmv_table_puts_the_pr_beside_stock_and_the_floor() -> None:
    """PR / stock and floor / PR are the row's own ratios: 40 / 50 = 0.80, 10 / 40 = 25 %."""
    bench = load_script("bench/mlx_qmv.py")
    report = _mlx_qmv_report(stock_us=50.0, pr_us=40.0, nbytes=40_000_000, copy=4e12)
    header, rule, row = bench.table(report).splitlines()
    assert "floor / PR" in header and rule.count("|") == header.count("|")
    assert row == "| 4 | 4096x4096 | 1 | 50.0 | 40.0 | 0.80 | 10.0 | 25% |"
    # A run that timed a call's own cost: the larger of it and the floor over the PR's
    # time, 16 / 40; control: a cost below the floor leaves the floor, 10 / 40.
    report["call_us"] = {"stock": 7.0, "pr": 16.0}
    header, rule, row = bench.table(report).splitlines()
    assert header.endswith("least / PR |") and rule.count("|") == header.count("|")
    assert row.endswith("| 25% | 40% |")
    report["call_us"] = {"stock": 7.0, "pr": 6.0}
    assert bench.table(report).splitlines()[2].endswith("| 25% | 25% |")
    assert bench.call_line([report]) == [
        "- A call's own cost (the same op on a 16x128 4-bit layer, one vector, timed as the "
        "layers are; median of the rounds, per run): stock 7.0 µs; PR 6.0 µs. No call takes "
        "less than the larger of its floor and that cost (`least / PR` in the table of times): "
        "where that is over twice the floor, floor / PR cannot reach 0.5 through MLX."
    ]
    assert bench.call_line([report, {**report, "call_us": None}]) == []  # control: a run without
    report["link_us"] = {"stock": 2.5, "pr": 2.0}  # its link timed alone, not in its calls
    assert "link" not in bench.call_line([report])[0]
    report["calls"] = "chained"  # a chained run: its calls include the link
    assert (
        "link to the call before (two elementwise ops), which alone, chained, takes: "
        "stock 2.5 µs; PR 2.0 µs." in bench.call_line([report])[0]
    )


def test_mlx_qmv_spread_line_names_cells_whose_rounds_disagree() -> None:
    """The page says how far each arm's rounds spread behind the medians and names the
    noisiest cell over 1.5x; control: rounds within it name none, and a run without rounds
    gives no line."""
    bench = load_script("bench/mlx_qmv.py")
    report = _mlx_qmv_report(stock_us=50.0, pr_us=40.0, nbytes=40_000_000, copy=4e12)
    row = report["rows"][0]
    quiet = {**report, "rows": [{**row, "stock_rounds_us": [50.0, 51.0, 52.0],
                                 "pr_rounds_us": [40.0, 40.0, 44.0]}]}  # fmt: skip
    (line,) = bench.spread_line([quiet])
    assert "stock median 1.04, largest 1.04; PR median 1.10, largest 1.10" in line
    assert line.endswith("No cell spreads over 1.5x.")
    noisy = {**report, "rows": [{**row, "M": 2, "stock_rounds_us": [50.0, 50.0, 50.0],
                                 "pr_rounds_us": [20.0, 40.0, 50.0]}]}  # fmt: skip
    (line,) = bench.spread_line([quiet, noisy])
    assert "PR median 1.80, largest 2.50" in line
    assert "1 of 2 cells spread over 1.5x in an arm" in line
    assert "bfloat16, group 64, 4-bit 4096x4096, M = 2, 2.50x" in line
    assert bench.spread_line([report]) == []


def test_mlx_qmv_targets_count_each_row_against_its_bound() -> None:
    """M = 1 counts floor / PR (at least 0.5) on layers of 2^24 weights or more only;
    M = 2..8 and 9..16 count PR / stock (at most 0.5 and 1.0). Worst and best per target."""
    bench = load_script("bench/mlx_qmv.py")

    def row(K: int, M: int, stock: float, pr: float, floor: float) -> dict:
        return {"K": K, "N": 4096, "bits": 4, "M": M, "bytes": 1, "stock_us": stock,
                "pr_us": pr, "floor_us": floor}  # fmt: skip

    report = {"rows": [
        row(4096, 1, 50.0, 20.0, 10.0),   # floor / PR 0.5: meets
        row(4096, 1, 50.0, 40.0, 10.0),   # 0.25: misses
        row(1024, 1, 50.0, 90.0, 1.0),    # a small layer: not counted at M = 1
        row(4096, 2, 40.0, 20.0, 1.0),    # 0.5: meets
        row(4096, 8, 20.0, 30.0, 1.0),    # 1.5: misses
        row(4096, 12, 30.0, 30.0, 1.0),   # 1.0: meets
    ]}  # fmt: skip
    one, few, many = bench.against_targets(report)
    assert (one["met"], one["of"], one["worst"], one["best"]) == (1, 2, 0.25, 0.5)
    assert (few["met"], few["of"], few["worst"], few["best"]) == (1, 2, 1.5, 0.5)
    assert (many["met"], many["of"]) == (1, 1)
    # No row is out of reach there: each floor is well below its target.
    assert (one["out_of_reach"], few["out_of_reach"], many["out_of_reach"]) == (0, 0, 0)


def test_mlx_qmv_targets_count_rows_no_kernel_could_meet() -> None:
    """A row is out of reach where even the floor (or the call's own cost, when the run
    timed it) misses the target: PR / stock <= 0.5 against a stock within twice the floor."""
    bench = load_script("bench/mlx_qmv.py")

    def row(M: int, stock: float, pr: float, floor: float) -> dict:
        return {"K": 8192, "N": 4096, "bits": 8, "M": M, "bytes": 1, "stock_us": stock,
                "pr_us": pr, "floor_us": floor}  # fmt: skip

    rows = [
        row(1, 40.0, 30.0, 12.0),  # floor / PR 0.4 misses; the floor itself would reach 1.0
        row(8, 20.0, 15.0, 12.0),  # stock 20 us, floor 12 us: PR / stock >= 0.6, out of reach
        row(8, 40.0, 15.0, 12.0),  # stock 40 us: 0.3 would be possible; 0.375 meets it
    ]
    one, few, _ = bench.against_targets({"rows": rows})
    assert (one["met"], one["out_of_reach"]) == (0, 0)
    assert (few["met"], few["of"], few["out_of_reach"]) == (1, 2, 1)
    # The one miss the bound allows is listed with how close it gets (30 us; 24 would
    # meet 0.5); the row out of reach and the row that meets are not.
    near = {"bits": 8, "K": 8192, "N": 4096, "M": 1, "value": 0.4, "pr_us": 30.0,
            "least_us": 12.0, "goal_us": 24.0, "pr_m1_us": 30.0}  # fmt: skip
    assert one["misses_in_reach"] == [near]
    assert few["misses_in_reach"] == []
    # With a call cost of 25 us timed, no M = 1 call can reach floor / PR 0.5 (12 / 25); the
    # M = 8 row that met it in 15 us stays reachable (a measured time disproves the bound).
    one, few, _ = bench.against_targets({"rows": rows, "call_us": {"stock": 30.0, "pr": 25.0}})
    assert (one["out_of_reach"], few["met"], few["out_of_reach"]) == (1, 1, 1)
    assert one["misses_in_reach"] == []  # out of reach now, so no longer listed
    # A run that timed no call cost (None) bounds by the floor alone.
    assert bench.against_targets({"rows": rows, "call_us": {"pr": None}})[1]["out_of_reach"] == 1


def test_mlx_qmv_counts_the_targets_again_without_layers_below_the_issues_range() -> None:
    """The issue sets its targets on layers of 2^23 weights and more; the pages also time
    a 2^22 layer and count it. A line gives the counts without it, and names it; a run
    with no such layer gets no line (the control)."""
    bench = load_script("bench/mlx_qmv.py")

    def row(K: int, N: int, M: int, stock: float, pr: float) -> dict:
        return {"K": K, "N": N, "bits": 4, "M": M, "bytes": 1, "stock_us": stock,
                "pr_us": pr, "floor_us": 1.0}  # fmt: skip

    big = [row(4096, 4096, 2, 40.0, 10.0), row(4096, 4096, 3, 40.0, 30.0)]  # meets; misses
    small = [row(4096, 1024, 2, 40.0, 30.0)]  # misses, within reach
    assert bench.in_scope_line([{"rows": big}]) == []
    line = bench.in_scope_line([{"rows": big + small}, {"rows": big}])[0]
    assert "the layers below the issue's 2^23 weights (4096x1024)" in line
    # Two runs of the big layer: 2 of 4 meet, the 2 others within reach; the small layer's
    # miss is not among them.
    assert "M = 2..8: PR / stock: 2 of 4 meet it, 0 out of reach, 2 missed within reach" in line
    assert "M = 9..16" not in line  # no row there: no count


def test_mlx_qmv_chained_calls_are_bounded_by_the_link_and_the_floor() -> None:
    """A chained call waits for the link's two ops before its kernel reads its bytes, so
    the least it can take is the link plus the floor; calls that do not wait are bounded
    by the floor alone, and a measured time below the bound disproves it."""
    bench = load_script("bench/mlx_qmv.py")
    row = {"K": 8192, "N": 4096, "bits": 4, "M": 1, "bytes": 1, "stock_us": 60.0,
           "pr_us": 30.0, "floor_us": 10.0}  # fmt: skip
    chained = {"rows": [row], "calls": "chained", "call_us": {"pr": 15.0},
               "link_us": {"pr": 12.0}}  # fmt: skip
    assert bench.least_us(chained, row) == 22.0  # 12 + 10, over the call's own 15
    # floor / PR 10 / 30 misses 0.5, and no call could meet it: 10 / 22 < 0.5
    assert bench.against_targets(chained)[0]["out_of_reach"] == 1
    # Control: the same run with independent calls is bounded by max(floor, call) = 15,
    # under which 10 / 15 would meet the target, so the miss is within reach.
    independent = dict(chained, calls="independent")
    assert bench.least_us(independent, row) == 15.0
    assert bench.against_targets(independent)[0]["out_of_reach"] == 0
    # A PR time under the bound caps it there (the measurement wins).
    fast = dict(row, pr_us=18.0)
    assert bench.least_us(chained, fast) == 18.0
    assert "least / PR" in bench.table(chained) and "| 73% |" in bench.table(chained)
    # The page says so where (and only where) the run waited for the link.
    timed = {"call_us": {"stock": 15.0, "pr": 15.0}, "link_us": {"stock": 12.0, "pr": 12.0}}
    assert "its floor plus that link and" in bench.call_line([dict(chained, **timed)])[0]
    assert "plus that link" not in bench.call_line([dict(independent, **timed)])[0]


def test_mlx_qmv_page_writes_targets_notes_and_generic_commands(tmp_path) -> None:
    """The page of two runs: one targets row and one ratio table per run, the notes on the
    page and in its JSON, and commands without the host's paths."""
    bench = load_script("bench/mlx_qmv.py")
    runs = []
    for dtype, group in (("bfloat16", 64), ("float16", 128)):
        run = _mlx_qmv_report(stock_us=50.0, pr_us=20.0, nbytes=40_000_000, copy=4e12)
        run.update(
            dtype=dtype,
            group_size=group,
            rounds=3,
            repeats=200,
            mlx={"stock": "0.32.1", "pr": "0.32.1+patchkit.abc"},
            hardware={"gpu": "NVIDIA H200, 580", "cpus": 16},
            command="python3 bench/mlx_qmv.py run --stock /tmp/x --json /root/out/r.json",
        )
        runs.append(run)  # fmt: skip
    build_record = {"backend": "cuda", "wheel_version": "0.32.1+patchkit.abc",
                    "patch": {"build_inputs_sha256": "f" * 64}}  # fmt: skip
    build = bench.timed_build(runs, build_record)
    bench.page(runs, tmp_path / "cuda", ["a note's text"], build)
    text = (tmp_path / "cuda.md").read_text()
    record = json.loads((tmp_path / "cuda.json").read_text())
    # the page names the build it timed by what that build compiled (decision 0008)
    assert record["build"] == {"backend": "cuda", "wheel_version": "0.32.1+patchkit.abc",
                               "build_inputs_sha256": "f" * 64}  # fmt: skip
    assert "build inputs sha256 `ffffffffffffffff`" in text
    # controls: a record of another build, and a file that is no build record
    with pytest.raises(SystemExit, match=r"is of MLX 0\.32\.1\+patchkit\.other"):
        bench.timed_build(runs, {**build_record, "wheel_version": "0.32.1+patchkit.other"})
    with pytest.raises(SystemExit, match="not a patchkit build record"):
        bench.timed_build(runs, {"wheel_version": "0.32.1+patchkit.abc"})
    assert "| bfloat16 | 64 | worst 0.50, best 0.50; 1 of 1 meet it |" in text
    assert "out of reach |" not in text  # control for the page below
    # An M = 8 row where stock runs within twice the floor: out of reach, said in its cell.
    tight = {**runs[0], "rows": [*runs[0]["rows"], {**runs[0]["rows"][0], "M": 8,
             "stock_us": 15.0, "pr_us": 14.0}]}  # fmt: skip
    bench.page([tight], tmp_path / "tight", [], build)
    assert "; 0 of 1 meet it, 1 out of reach |" in (tmp_path / "tight.md").read_text()
    assert "## Missed, not out of reach" not in text + (tmp_path / "tight.md").read_text()
    # An M = 8 row that misses 0.5 (30 of 50 us) while its floor allows it: listed.
    near = {**runs[0], "rows": [*runs[0]["rows"], {**runs[0]["rows"][0], "M": 8,
            "pr_us": 30.0}]}  # fmt: skip
    bench.page([near], tmp_path / "near", [], build)
    near_text = (tmp_path / "near.md").read_text()
    assert "## Missed, not out of reach" in near_text
    row = "| M = 2..8: PR / stock (target 0.5) | 4 | 4096x4096 | 8 | 0.60 | 30.0 | 25.0 |"
    assert row in near_text, near_text
    m1 = next(r["pr_us"] for r in runs[0]["rows"] if r["M"] == 1)
    assert near_text.split(row)[1].split("\n")[0].endswith(f" | {m1:.1f} |")
    # 25 us meets it: more than that M = 1 call takes, so the batch is what misses ...
    assert m1 < 25.0 and "Of the 1 at M > 1, 0 would meet" in near_text
    # ... and control: with M = 1 slower than 25 us, only a faster single vector would.
    slow = {**near, "rows": [{**r, "pr_us": 26.0} if r["M"] == 1 else r for r in near["rows"]]}
    bench.page([slow], tmp_path / "slow", [], build)
    assert "Of the 1 at M > 1, 1 would meet" in (tmp_path / "slow.md").read_text()
    assert text.count("## PR / stock:") == 2 and "- Note: a note's text" in text
    assert bench.CALLS_TEXT["independent"] in text  # runs that do not say: the old method
    chained = [{**r, "calls": "chained"} for r in runs]
    bench.page(chained, tmp_path / "chained", [], build)
    assert bench.CALLS_TEXT["chained"] in (tmp_path / "chained.md").read_text()
    with pytest.raises(SystemExit, match="the runs differ in calls"):
        bench.page([chained[0], runs[1]], tmp_path / "mixed-calls", [], build)
    assert "meet it | not measured | not measured |" in text  # no M > 1 rows
    assert '--note "a note\'s text"' in text or "--note 'a note'\"'\"'s text'" in text
    assert record["notes"] == ["a note's text"] and len(record["summary"]) == 2
    assert not any("/tmp" in r["command"] or "/root" in r["command"] for r in record["runs"])
    # runs that do not say timed independent calls: the command that reruns them says so
    assert record["runs"][0]["command"].endswith(
        "--dtype bfloat16 --group-size 64 --quick --calls independent"
    )
    runs[0]["rows"][0]["N"] = 14336 * 2  # a layer --quick does not time
    runs[0]["repeats"] = 50
    assert bench.generic_command(runs[0]).endswith("--repeats 50 --calls independent")
    assert bench.generic_command({**runs[0], "calls": "chained"}).endswith("--repeats 50")
    runs[1]["mlx"] = {"stock": "0.32.1", "pr": "0.32.1+patchkit.other"}
    with pytest.raises(SystemExit, match="the runs differ in mlx"):
        bench.page(runs, tmp_path / "mixed", [], build)


class _Recorded:
    """A stand-in array that knows which matmul outputs it was computed from."""

    def __init__(self, made_from: frozenset[int] = frozenset()) -> None:
        self.made_from = made_from

    def __getitem__(self, _index: object) -> _Recorded:
        return _Recorded(self.made_from)

    def __mul__(self, other: object) -> _Recorded:
        return _Recorded(self.made_from | getattr(other, "made_from", frozenset()))

    __add__ = __mul__


class _RecordingMx:
    """Records the x each quantized_matmul gets; each output is its own source."""

    def __init__(self) -> None:
        self.xs: list[_Recorded] = []

        self.weights: list[object] = []

    def quantized_matmul(self, x: _Recorded, w: object, *_args: object) -> _Recorded:
        self.xs.append(x)
        self.weights.append(w)
        return _Recorded(x.made_from | {len(self.xs) - 1})


def test_mlx_qmv_times_calls_that_depend_on_each_other() -> None:
    """Call i's x is made from call i - 1's output, so MLX's CUDA graph cannot run two
    calls at once (it links nodes by the buffers they read)."""
    bench = load_script("bench/mlx_qmv.py")
    mx = _RecordingMx()
    outs = bench._calls(mx, _Recorded(), [["w0"], ["w1"], ["w2"]], 4, 64, 5)
    assert len(outs) == 5 and mx.xs[0].made_from == frozenset()
    assert [max(x.made_from) for x in mx.xs[1:]] == [0, 1, 2, 3]
    assert mx.weights == ["w0", "w1", "w2", "w0", "w1"]  # each copy in turn: read cold
    control = _RecordingMx()  # --calls independent: no call's x is made from another's
    bench._calls(control, _Recorded(), [["w0"]], 4, 64, 3, chained=False)
    assert [x.made_from for x in control.xs] == [frozenset()] * 3


def test_mlx_qmv_chain_keeps_the_values_of_x() -> None:
    """The link between calls adds zero: every call's output equals what the same x alone
    gives (on MLX's CPU; -0 may become +0, which no product tells apart), and a link that
    changed x would not."""
    mx = pytest.importorskip("mlx.core")
    bench = load_script("bench/mlx_qmv.py")
    w = mx.quantize(mx.random.normal((64, 256)).astype(mx.bfloat16), group_size=64, bits=4)
    x = mx.random.normal((3, 256)).astype(mx.bfloat16)
    alone = mx.quantized_matmul(x, *w, True, 64, 4)
    outs = bench._calls(mx, x, [list(w)], 4, 64, 4)
    mx.eval(alone, outs)
    assert all(mx.array_equal(out, alone).item() for out in outs)
    drift = x + alone[..., :1] * 1  # control: a chain that does not add zero
    assert not mx.array_equal(mx.quantized_matmul(drift, *w, True, 64, 4), alone).item()


def _harness_result(patched: float, stock: float, differing: int = 0) -> dict:
    seconds = {str(m): {"patched": patched * m**0.5, "stock": stock * m} for m in cuda.MS}
    return {
        "config": {"K": 4096, "N": 4096, "bits": 4, "group_size": 64, "dtype": "bfloat16"},
        "weight_bytes": 8_650_752,
        "parity": {
            "rows": sum(cuda.MS),
            "differing": differing,
            "odd_neighbours_differing": 0,
            "control_flipped_bit": 1,
            "control_reference": 3,
            "max_error": {"patched": 3e-3, "stock": 4e-3},
        },
        "seconds": seconds,
    }


def test_harness_report_counts_rows_and_bandwidth() -> None:
    """The report sums rows over layers, puts M = 1 bandwidth against the measured copy
    bandwidth, and names a differing row; a clean record says 0."""
    host = {"copy_bytes_per_s": 4e12}
    clean = cuda.report({"host": host, "results": [_harness_result(4e-6, 5e-6)] * 2})
    assert f"0 of {2 * sum(cuda.MS)} differ" in clean
    assert "differ in every config" in clean
    row = next(line for line in clean.splitlines() if line.startswith("| bfloat16"))
    # 8,650,752 bytes in 4 µs is 2.16 TB/s: 54 % of 4 TB/s; stock's 5 µs: 43 %.
    assert "| 54% | 43% | 3.0e-03 / 4.0e-03 | 0.80 |" in row
    bad = cuda.report({"host": host, "results": [_harness_result(4e-6, 5e-6, differing=2)]})
    assert f"2 of {sum(cuda.MS)} differ" in bad


def test_report_gives_m1_error_ranges_per_kind() -> None:
    """The error table gives each (dtype, group, bits) its range over the layers and the
    ratio's range; a kind whose layers agree shows one value, not a range of two equal."""
    second = _harness_result(4e-6, 5e-6)
    second["parity"]["max_error"] = {"patched": 4e-3, "stock": 4e-3}
    other = _harness_result(4e-6, 5e-6)
    other["config"] = {**other["config"], "dtype": "float16", "bits": 8}
    text = cuda.report({"host": {"copy_bytes_per_s": 4e12},
                        "results": [_harness_result(4e-6, 5e-6), second, other]})  # fmt: skip
    dash = cuda.EN_DASH
    assert f"| bfloat16 | 64 | 4 | 2 | 3.0e-03{dash}4.0e-03 | 4.0e-03 | 0.75{dash}1.00 |" in text
    assert "| float16 | 64 | 8 | 1 | 3.0e-03 | 4.0e-03 | 0.75 |" in text
    assert "build inputs" not in text  # a run of libraries without build.json names none


def test_the_kernel_stock_page_is_the_report_of_its_run() -> None:
    """docs/results/cuda-kernel-stock.md holds every line ``report`` prints from its JSON
    (the libraries' build inputs included), and the command that prints them."""
    page = (ROOT / "docs" / "results" / "cuda-kernel-stock.md").read_text().splitlines()
    run = json.loads((ROOT / "docs" / "results" / "cuda-kernel-stock.json").read_text())
    made = [ln for ln in cuda.report(run).splitlines() if ln]
    assert len(made) > 20 and [ln for ln in made if ln not in page] == []
    assert any("of build inputs sha256" in ln for ln in made)
    assert "python3 bench/cuda_qmv.py report docs/results/cuda-kernel-stock.json" in page


def test_variant_report_names_each_variants_rows_and_times() -> None:
    """compare-report gives every variant its own count of differing rows and a column of
    microseconds beside stock's; one variant's differing row is not hidden by another's."""
    one = _harness_result(4e-6, 5e-6)
    result = {
        "config": one["config"],
        "weight_bytes": one["weight_bytes"],
        "parity": {"A": one["parity"], "B": {**one["parity"], "differing": 1}},
        "seconds": {"1": {"stock": 5e-6, "A": 4e-6, "B": 4.5e-6}},
    }
    text = cuda.compare_report({"variants": ["A", "B"], "results": [result]})
    assert "A 0 differ, B 1 differ" in text
    assert "| 4 | 4096x4096 | 1 | 5.0 | 4.0 | 4.5 |" in text


def test_variants_that_sum_in_one_order_are_held_to_one_reference() -> None:
    """Only the warps over K each compared layer gets decide a vector's order: variants
    that give every layer the same are checked against the first of their group (also when
    their constants differ, as f and g); other values start their own group."""
    refs = cuda.same_order_references({
        "a": [1, 4, 16, 8, 8192, 4], "b": [2, 8, 8, 8, 8192, 4],
        "c": [1, 4, 16, 8, 0, 4], "d": [2, 6, 16, 8, 0, 4], "e": [1, 4, 16, 8, 8192, 2],
        "f": [1, 4, 16, 8, 1 << 30, 4], "g": [1, 4, 16, 8, 0, 8],
    })  # fmt: skip
    assert refs == {"b": "a", "d": "c", "g": "f"}
    assert cuda.k_warps_for([1, 4, 16, 8, 8192, 4], 8191) == 8
    assert cuda.k_warps_for([1, 4, 16, 8, 8192, 4], 8192) == 4
    assert cuda.same_order_references({"only": [1, 4, 16, 8, 8192, 4]}) == {}
    # the shipped kernel is the reference of its group, whatever the names
    assert cuda.same_order_references(
        {"a": [2, 4, 8, 8, 8192, 4], cuda.SHIPPED: [1, 4, 16, 8, 8192, 4]}
    ) == {"a": cuda.SHIPPED}


def test_a_variant_of_its_own_order_is_held_to_its_own_m1_only() -> None:
    """A template variant whose diff header declares its own summation order is nobody's
    reference and has none, whatever its launch constants; the same constants without the
    declaration are held to the shipped kernel (the control)."""
    shipped = [1, 4, 16, 8, 8192, 4]
    both = {cuda.SHIPPED: shipped, "mine": shipped, "other": [1, 3, 16, 8, 8192, 4]}
    assert cuda.same_order_references(both) == {"mine": cuda.SHIPPED, "other": cuda.SHIPPED}
    assert cuda.same_order_references(both, {"mine"}) == {"other": cuda.SHIPPED}
    assert cuda.same_order_references({"mine": shipped, "b": shipped}, {"mine"}) == {}


def test_own_order_is_read_from_the_diff_header_only() -> None:
    body = "diff --git a/t b/t\n--- a/t\n+++ b/t\n@@ -1 +1 @@\n-a\n+b\n"
    assert cuda.declares_own_order(f"Why this variant.\n{cuda.OWN_ORDER}\n\n{body}")
    assert not cuda.declares_own_order(f"Why this variant.\n\n{body}")
    # the words inside the diff (an added line) do not declare it
    assert not cuda.declares_own_order(body + f"+{cuda.OWN_ORDER}\n")
    assert not cuda.declares_own_order(f"{body}diff --git a/u b/u\n{cuda.OWN_ORDER}\n")
    plain = body.removeprefix("diff --git a/t b/t\n")  # no git header: `---` ends the header
    assert cuda.declares_own_order(f"{cuda.OWN_ORDER}\n{plain}")
    assert not cuda.declares_own_order(plain.replace("-a\n", f" {cuda.OWN_ORDER}\n-a\n"))


def test_variant_report_counts_rows_across_variants() -> None:
    """A differing row between variants of one order shows in the report's first lines."""
    one = _harness_result(4e-6, 5e-6)
    result = {
        "config": one["config"],
        "parity": {"a": one["parity"], "b": one["parity"]},
        "across": {"b": {"rows": 186, "differing": 3}},
        "control": {"a": {"rows": 186, "differing": 0}},
        "seconds": {"1": {"stock": 5e-6, "a": 4e-6, "b": 4e-6}},
    }
    data = {"variants": ["a", "b"], "references": {"b": "a"}, "controls": {"a": "c"},
            "results": [result]}  # fmt: skip
    text = cuda.compare_report({**data, "group_size": 128})
    assert text.startswith("bfloat16, group 128. Rows of each variant")
    assert "b against a's M = 1: 3 of 186 differ;" in text
    # a control that finds no difference says the check is blind
    assert "c (other warps over K) against a's M = 1: 0 of 186 differ: NONE" in text


def _summary_run(group: int, times: dict[tuple[int, int, int], dict[str, float]]) -> dict:
    """A compare run of layers (K, N, bits) -> {M: arm "a"'s time}, "shipped" at 1 s."""
    parity = _harness_result(4e-6, 5e-6)["parity"]
    results = [
        {"config": {"K": K, "N": N, "bits": bits}, "parity": {"a": parity, "shipped": parity},
         "seconds": {str(m): {"stock": 2.0, "shipped": 1.0, "a": t} for m, t in by_m.items()}}
        for (K, N, bits), by_m in times.items()
    ]  # fmt: skip
    return {"variants": ["a", "shipped"], "group_size": group, "results": results,
            "constants": {"shipped": [1, 4, 16, 8, 8192, 4]}}  # fmt: skip


def ranges(text: str) -> str:
    """``text`` with each ``-`` an en dash, as the pages write a range."""
    return text.replace("-", cuda.EN_DASH)


def test_compare_summary_takes_geometric_means_over_layers_and_m() -> None:
    """compare-summary: per run, arm and bits, the geometric mean and range of the arm's
    time over the reference's at M = 1..8 and 9..16; --min-n keeps wide layers only; the
    by-layer table puts one value per run in each cell."""
    times = {(4096, 4096, 4): {1: 0.5, 8: 2.0, 16: 0.25},
             (4096, 14336, 4): {1: 2.0, 8: 2.0, 16: 1.0},
             (4096, 14336, 8): {1: 1.5, 9: 3.0}}  # fmt: skip
    runs = [_summary_run(128, times), _summary_run(64, {k: {m: 1.0 for m in v}
                                                          for k, v in times.items()})]  # fmt: skip
    text = cuda.compare_summary(runs, by_layer="a", by_layer_ms=(1, 16))
    # 4-bit M = 1..8: 0.5, 2, 2, 2 -> geomean 2^(2/4) = 1.41; M = 9..16: 0.25, 1 -> 0.5
    assert ranges("| 128 | `a` | 1.41 (0.50-2.00) | 0.50 (0.25-1.00) | 1.50 (1.50-1.50) |") in text
    assert ranges("3.00 (3.00-3.00) |") in text
    assert ranges("| 64 | `a` | 1.00 (1.00-1.00) | 1.00 (1.00-1.00) |") in text
    assert "| 4 | 4096x4096 | 8 | 0.50 / 1.00 | 0.25 / 1.00 |" in text
    assert "| 8 | 4096x14336 | 4 | 1.50 / 1.00 | — / — |" in text  # no M = 16 timed there
    assert text.startswith("bfloat16, group 128. Rows of each variant")
    wide = cuda.compare_summary(runs[:1], min_n=8192)
    assert ranges("| 128 | `a` | 2.00 (2.00-2.00) | 1.00 (1.00-1.00) |") in wide  # the control
    with pytest.raises(ValueError, match="no arm 'b'"):
        cuda.compare_summary(runs, by_layer="b")
    with pytest.raises(ValueError, match="at least one"):
        cuda.compare_summary([])


@pytest.mark.parametrize(
    ("name", "cases"),
    [
        ("cuda-kernel-launch", (([0, 1], 0, "t2s2"), ([2, 3], 8192, None))),
        ("cuda-kernel-small-layers", ((None, 0, "kw16"), (None, 0, "s2"))),
    ],
)
def test_a_launch_page_is_compare_summary_of_its_runs(name: str, cases: tuple) -> None:
    """A kernel-alone launch page's tables are what compare-summary prints from the runs
    its JSON holds, as its commands say: the page is made, not summarised by hand."""
    page = (ROOT / "docs" / "results" / f"{name}.md").read_text()
    runs = json.loads((ROOT / "docs" / "results" / f"{name}.json").read_text())["runs"]
    for pick, min_n, by_layer in cases:
        chosen = runs if pick is None else [runs[i] for i in pick]
        text = cuda.compare_summary(chosen, min_n=min_n, by_layer=by_layer)
        tables = [ln for ln in text.splitlines() if ln.startswith("| ")]
        assert len(tables) > 6 and all(ln in page.splitlines() for ln in tables), pick
        runs_flag = "" if pick is None else " --runs " + ",".join(map(str, pick))
        layer_flag = f" --by-layer {by_layer}" if by_layer and pick is None else ""
        assert f"compare-summary docs/results/{name}.json{runs_flag}{layer_flag}" in page


def test_compare_report_commands_print_and_exit_0(tmp_path: Path) -> None:
    """compare-report and compare-summary from the command line: each prints its page and
    ends there with status 0 (neither goes on into another subcommand's code)."""
    run_json = tmp_path / "g.json"
    run_json.write_text(json.dumps(_summary_run(64, {(4096, 4096, 4): {1: 0.5}})))
    script = str(ROOT / "bench" / "cuda_qmv.py")
    for argv, expected in [
        (["compare-report", str(run_json)], "| 4 | 4096x4096 | 1 | 2000000.0 | 500000.0 |"),
        (["compare-summary", str(run_json)], "| 64 | `a` |"),
    ]:
        done = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        assert expected in done.stdout


def test_compare_summary_command_errors_are_one_line(tmp_path: Path) -> None:
    bench = load_script("bench/cuda_qmv.py")
    good = tmp_path / "g.json"
    good.write_text(json.dumps(_summary_run(64, {(4096, 4096, 4): {1: 1.0}})))
    assert "| 64 | `a` |" in bench.compare_summary([good], "shipped", 0, None, "1,8,16")
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "empty.json").write_text("{}")
    for paths, ms, pick, why in [
        (["nowhere.json"], "1", None, "cannot read"), (["bad.json"], "1", None, "cannot read"),
        (["empty.json"], "1", None, "holds no compare run"), (["g.json"], "1,x", None, "--ms"),
        (["g.json"], "1", "3", "hold 1 runs"), (["g.json"], "1", None, "no arm 'nope'"),
    ]:  # fmt: skip
        against = "nope" if "nope" in why else "shipped"
        with pytest.raises(SystemExit, match=why) as exc:
            bench.compare_summary([tmp_path / p for p in paths], against, 0, None, ms, pick)
        assert "\n" not in str(exc.value)


def _split_output(failing: dict[str, list[str]], passing: list[str]) -> list[str]:
    """What ``patchkit.util.split_unittest`` prints for methods that pass or fail."""
    lines = []
    for m in passing:
        lines += [f"== test_quantized.TestQuantized.{m}: ok in 1.0s", "    Ran 1 test in 1.0s"]
    for m, subtests in failing.items():
        lines.append(f"== test_quantized.TestQuantized.{m}: FAILED in 2.0s")
        lines += [f"    FAIL: {m} (test_quantized.TestQuantized.{m}) ({s})" for s in subtests]
    return lines


def test_mlx_tests_tells_the_prs_own_failures_from_stocks(tmp_path) -> None:
    bench = load_script("bench/mlx_tests.py")
    methods = ["test_a", "test_b", "test_new", "test_slow"]
    stock = _split_output({"test_a": ["k=1", "k=2"], "test_new": ["M=8"]}, ["test_b"])
    same = _split_output({"test_a": ["k=1"]}, ["test_b", "test_new"])
    got = bench.side_by_side({"stock": stock, "pr": same}, methods)
    assert got["pr_failing_also_on_stock"] == 1 and got["pr_failing_only_on_pr"] == []
    assert got["stock_failing_only_on_stock"] == 2  # test_a k=2, test_new M=8
    assert got["arms"]["pr"]["test_slow"]["verdict"] == "UNFINISHED"  # in neither output
    # Control: a subtest failing on the PR alone is named.
    worse = _split_output({"test_a": ["k=1"], "test_b": ["k=9"]}, ["test_new"])
    got = bench.side_by_side({"stock": stock, "pr": worse}, methods)
    assert got["pr_failing_only_on_pr"] == [
        "test_b: FAIL: test_b (test_quantized.TestQuantized.test_b) (k=9)"
    ]
    meta = {"module": "test_quantized", "command": "c", "how": None, "hardware": {"gpu": "g"}}
    page = bench.page({**meta, "mlx": {"pr": "p", "stock": "s"}, **got})
    summary = "- PR: 1 methods passed or skipped, 2 failed (2 failing subtests), 1 not run to"
    assert summary in page
    assert "| `test_b` | failed | 1 | passed |  |" in page
    # --only: the methods named are compared, the others left out of both arms
    got = bench.side_by_side({"stock": stock, "pr": worse}, ["test_a"])
    assert set(got["arms"]["pr"]) == set(got["arms"]["stock"]) == {"test_a"}
    assert got["pr_failing_only_on_pr"] == [] and got["stock_failing_only_on_stock"] == 1
    page = bench.page({**meta, "mlx": {"pr": "p", "stock": "s"}, "only": ["test_a"], **got})
    assert "- Methods compared: test_a; the others not run or left out" in page
    # Named beside those the build failed: the page says which were which.
    built = {"only_failed_in_build": True, "failed_in_build": ["test_a"]}
    page = bench.page(
        {**meta, "mlx": {"pr": "p", "stock": "s"}, "only": ["test_a"], **built, **got}
    )
    assert "- Methods compared: test_a (those the build's own run of the file failed);" in page
    page = bench.page({**meta, "mlx": {"pr": "p", "stock": "s"}, "only": ["test_b", "test_a"],
                       **built, **got})  # fmt: skip
    assert ("- Methods compared: test_b, test_a (failed in the build's own run of the file: "
            "test_a; the others named to run)") in page  # fmt: skip
    # A method stock did not run to the end: the PR's failures there are not its own.
    cut = stock[: stock.index("== test_quantized.TestQuantized.test_a: FAILED in 2.0s")]
    got = bench.side_by_side({"stock": cut, "pr": worse}, methods)
    assert got["arms"]["stock"]["test_a"]["verdict"] == "UNFINISHED"
    assert got["pr_failing_only_on_pr"] == [
        "test_b: FAIL: test_b (test_quantized.TestQuantized.test_b) (k=9)"
    ]  # test_b ended on stock (passed): still the PR's own
    assert got["pr_failing_not_compared"] == 1 and got["pr_failing_also_on_stock"] == 0
    page = bench.page({**meta, "mlx": {"pr": "p", "stock": "s"}, **got})
    assert "not compared, their method not run to the end on stock: 1" in page
    # A sharded method with one shard failing and one cut off is FAILED yet not compared.
    half = [
        "== test_quantized.TestQuantized.test_a [1/2]: FAILED in 2.0s",
        "    FAIL: test_a (test_quantized.TestQuantized.test_a) (k=1)",
        "== test_quantized.TestQuantized.test_a [2/2]: UNFINISHED in 9.0s",
        *_split_output({"test_new": ["M=8"]}, ["test_b"]),
    ]
    pr = _split_output({"test_a": ["k=1", "k=3"]}, ["test_b", "test_new"])
    got = bench.side_by_side({"stock": half, "pr": pr}, methods)
    assert got["arms"]["stock"]["test_a"]["verdict"] == "FAILED"
    assert got["pr_failing_also_on_stock"] == 1 and got["pr_failing_only_on_pr"] == []
    assert got["pr_failing_not_compared"] == 1  # k=3: in the shard that never ended
    assert got["stock_failing_only_on_stock"] == 1  # test_new M=8: ended on the PR, passed
    # A build record keeps that: the method failed, and it is listed as cut off.
    from patchkit.carry import mlx_build

    kept = mlx_build.method_results(half)
    assert kept["per_test"]["test_a"] == "failed" and kept["unfinished"] == []
    assert kept["cut_off"] == ["test_a"]
    assert bench.recorded_arm(Path("r.json"), {"tests": kept, "patch": bench.series()})[
        "test_a"
    ].get("cut_off")


def test_rebase_gate_page_shows_each_scenarios_seconds() -> None:
    bench = load_script("bench/rebase_gate.py")
    report = {
        "command": "c", "to": "06f154bc", "host": {"system": "Linux", "cpus": 2, "python": "3"},
        "scenarios": {
            "cold": {"wall_s": 240.4, "gate_s": 232.1},
            "after set-up": {"wall_s": 9.2, "gate_s": 1.4, "setup_emulate_s": 80.6},
        },
    }  # fmt: skip
    page = bench.page(report)
    assert "| cold | 240 | 232 |  |" in page and "| after set-up | 9 | 1 | 81 |" in page
    assert "within 180 s (on a 2-core machine): met here (9 s)" in page
    report["scenarios"]["after set-up"]["wall_s"] = 181.0
    assert "within 180 s (on a 2-core machine): missed here (181 s)" in bench.page(report)


def test_the_readme_set_up_runs_every_toolchain_of_the_gate() -> None:
    """The gate answers a no-kernel-text bump at once only for the toolchains the set-up ran
    (verdicts are kept per toolchain): the README's `patchkit emulate` line must run them all."""
    bench = load_script("bench/rebase_gate.py")
    from patchkit.verify.emulate import build, cli_support

    args = bench.setup_args()
    choice = args[args.index("--toolchain") + 1] if "--toolchain" in args else "gcc"
    assert set(cli_support._toolchains(choice)) == set(build.GATE)


def test_mlx_tests_arms_split_subtests_when_asked(tmp_path: Path, monkeypatch) -> None:
    """bench/mlx_tests.py passes --shards on to both arms' split_unittest runs, and removes
    the arms' JIT caches after them."""
    mlx_tests = load_script("bench/mlx_tests.py")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    (tmp_path / "test_quantized.py").write_text(
        "import unittest\n\nclass T(unittest.TestCase):\n    def test_a(self):\n"
        "        for k in range(4):\n            with self.subTest(k=k):\n"
        "                self.assertLess(k, 3)\n"
    )
    outputs = mlx_tests.run_arms(
        {"stock": sys.executable, "pr": sys.executable}, tmp_path, 2, None, shards=2
    )
    for lines in outputs.values():
        assert sum(ln.startswith("== test_quantized.T.test_a [") for ln in lines) == 2
        assert lines[-1] == "FAILED (failures=1)"
    assert not list(scratch.iterdir())


def test_mlx_tests_reruns_beside_stock_what_the_builds_run_failed(tmp_path: Path) -> None:
    """``--only-failed-in BUILD.json`` runs on both arms the methods the build record's own
    run failed, and no other; a record with nothing failed runs nothing and says so."""
    (tmp_path / "test_quantized.py").write_text(
        "import unittest\n\nclass T(unittest.TestCase):\n    def test_a(self):\n"
        "        self.assertEqual(1, 2)\n\n    def test_b(self):\n        pass\n"
    )
    record = tmp_path / "build-cuda.json"

    def run(per_test: dict[str, str]) -> tuple[dict, str]:
        record.write_text(json.dumps({"tests": {"per_test": per_test}}))
        argv = [sys.executable, str(ROOT / "bench" / "mlx_tests.py"), "run",
                "--stock", sys.executable, "--patched", sys.executable, "--tests",
                str(tmp_path), "--json", str(tmp_path / "t.json"), "--md",
                str(tmp_path / "t.md"), "--jobs", "1", "--only-failed-in", str(record)]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        return json.loads((tmp_path / "t.json").read_text()), (tmp_path / "t.md").read_text()

    data, page = run({"test_a": "failed", "test_b": "passed"})
    assert set(data["arms"]["pr"]) == set(data["arms"]["stock"]) == {"test_a"}
    assert data["arms"]["stock"]["test_a"]["verdict"] == "FAILED"
    assert data["pr_failing_also_on_stock"] == 1 and data["pr_failing_only_on_pr"] == []
    assert "- Methods compared: test_a (those the build's own run of the file failed)" in page
    # control: nothing failed in the build's run, nothing runs
    data, page = run({"test_a": "passed", "test_b": "passed"})
    assert data["arms"] == {"pr": {}, "stock": {}}
    assert "- Methods compared: none (those the build's own run of the file failed)" in page


def test_mlx_tests_takes_the_prs_arm_from_its_builds_log(tmp_path: Path) -> None:
    """``--patched-log BUILD_LOG``: only stock runs; the PR's arm is the log's run of the
    file, labelled with its record's MLX. A log that is not of that record's build (another
    run, or a build without tests) and a log without its record are one-line errors."""
    (tmp_path / "test_quantized.py").write_text(
        "import unittest\n\nclass T(unittest.TestCase):\n    def test_a(self):\n"
        "        self.assertEqual(1, 2)\n\n    def test_b(self):\n        pass\n"
    )
    record, log = tmp_path / "build-cuda.json", tmp_path / "build.log"
    verdicts = {"test_a": "failed", "test_b": "passed"}
    record.write_text(json.dumps({"mlx_version": "0.32.1+patchkit.abc",
                                  "tests": {"per_test": verdicts}}))  # fmt: skip
    compiled = ["[1/2] nvcc qmv.cu", "$ python -m patchkit.util.split_unittest test_quantized"]
    log.write_text("\n".join(compiled + _split_output({"test_a": ["k=1"]}, ["test_b"])) + "\n")

    def run(*extra: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, str(ROOT / "bench" / "mlx_tests.py"), "run",
                "--stock", sys.executable, "--patched-log", str(log), "--tests", str(tmp_path),
                "--json", str(tmp_path / "t.json"), "--md", str(tmp_path / "t.md"),
                "--jobs", "1", *extra]  # fmt: skip
        return subprocess.run(argv, capture_output=True, text=True, check=False)

    done = run("--only-failed-in", str(record))
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["mlx"]["pr"] == "0.32.1+patchkit.abc" and data["patched_log"] is True
    assert data["arms"]["pr"]["test_a"]["problems"] == [
        "FAIL: test_a (test_quantized.TestQuantized.test_a) (k=1)"
    ]
    assert data["arms"]["stock"]["test_a"]["verdict"] == "FAILED"  # run here, really
    assert set(data["arms"]["stock"]) == {"test_a"}
    assert (
        "its build's own run of the whole file (build.log), not run again"
        in (tmp_path / "t.md").read_text()
    )
    # Controls: another build's record, a build without tests, no record at all.
    record.write_text(json.dumps({"tests": {"per_test": {"test_b": "failed"}}}))
    done = run("--only-failed-in", str(record))
    assert done.returncode != 0 and "not one build's" in done.stderr.strip().splitlines()[-1]
    record.write_text(json.dumps({"tests": {"per_test": {"test_a": "failed"}}}))
    log.write_text("\n".join(compiled) + "\n")
    done = run("--only-failed-in", str(record))
    assert done.returncode != 0 and "holds no run of test_quantized.py" in done.stderr
    assert "needs --only-failed-in" in run().stderr
    done = run("--only-failed-in", str(tmp_path / "nowhere.json"))
    assert done.returncode != 0 and done.stderr.startswith("--only-failed-in: cannot read ")
    assert len(done.stderr.strip().splitlines()) == 1


def test_mlx_tests_takes_the_prs_arm_from_its_builds_record(tmp_path: Path) -> None:
    """``--patched-record BUILD_JSON``: only stock runs, the methods the record's run failed
    and those named; the PR's arm is the record's verdicts and failing subtests, labelled
    with its MLX and its GPU. A record of another patch, without a test run, of verdicts it
    does not know, not a record at all or missing, and another --only-failed-in are
    one-line errors; a record that does not list the methods a deadline cut off has its
    failed ones counted as cut off."""
    bench = load_script("bench/mlx_tests.py")
    (tmp_path / "test_quantized.py").write_text(
        "import unittest\n\nclass T(unittest.TestCase):\n    def test_a(self):\n"
        "        self.assertEqual(1, 2)\n\n    def test_b(self):\n        pass\n\n"
        "    def test_c(self):\n        pass\n"
    )
    record = tmp_path / "build-cuda.json"
    header = "FAIL: test_a (test_quantized.TestQuantized.test_a) (k=1)"
    tests = {"per_test": {"test_a": "failed", "test_b": "passed", "test_c": "skipped"},
             "failing_subtests": {"test_a": [header]}, "cut_off": []}  # fmt: skip
    built = {"mlx_version": "0.32.1+patchkit.abc", "machine": {"gpu": "GPU X"}, "tests": tests,
             "patch": bench.series()}  # fmt: skip
    record.write_text(json.dumps(built))

    def run(*extra: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, str(ROOT / "bench" / "mlx_tests.py"), "run",
                "--stock", sys.executable, "--patched-record", str(record),
                "--tests", str(tmp_path), "--json", str(tmp_path / "t.json"),
                "--md", str(tmp_path / "t.md"), "--jobs", "1", *extra]  # fmt: skip
        return subprocess.run(argv, capture_output=True, text=True, check=False)

    done = run("--only", "test_b")
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["mlx"]["pr"] == "0.32.1+patchkit.abc" and data["patched_record"] is True
    assert data["failed_in_build"] == ["test_a"] and data["only"] == ["test_b", "test_a"]
    assert data["arms"]["pr"] == {
        "test_a": {"verdict": "FAILED", "seconds": None, "problems": [header],
                   "sections": 1, "skipped_sections": 0},
        "test_b": {"verdict": "ok", "seconds": None, "problems": [], "sections": 1,
                   "skipped_sections": 0},
    }  # fmt: skip
    # Stock really ran the two methods (and only those): its own failure is its own.
    assert set(data["arms"]["stock"]) == {"test_a", "test_b"}
    assert data["arms"]["stock"]["test_a"]["verdict"] == "FAILED"
    assert data["arms"]["stock"]["test_a"]["seconds"] is not None
    assert data["pr_failing_also_on_stock"] == 0 and len(data["pr_failing_only_on_pr"]) == 1
    md = (tmp_path / "t.md").read_text()
    assert "as its record (build-cuda.json, on GPU X) keeps it, not run again" in md
    assert "--patched-record build-cuda.json" in data["command"]
    assert data["stock_failing_not_compared"] == 0
    # A record that does not list what a deadline cut off: its failure is not compared.
    record.write_text(json.dumps({**built, "tests": {**tests, "cut_off": None}}))
    assert run("--only", "test_b").returncode == 0
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["arms"]["pr"]["test_a"]["cut_off"] is True
    assert "cut_off" not in data["arms"]["pr"]["test_b"]
    assert data["stock_failing_not_compared"] == 1
    # Controls: another patch's record, a build without tests, an unknown verdict, not a
    # record, no file, a second record.
    stale = {**built["patch"], "build_inputs_sha256": "0" * 64}
    record.write_text(json.dumps({**built, "patch": stale}))
    done = run()
    assert done.returncode != 0 and "is of another patch than this checkout's" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    record.write_text(json.dumps({**built, "tests": None}))
    done = run()
    assert done.returncode != 0 and "holds no run of test_quantized.py" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    record.write_text("[1, 2]")
    done = run()
    assert done.stderr.strip() == f"--patched-record: {record} is not a patchkit build record"
    record.unlink()
    assert run().stderr.startswith(f"--patched-record: cannot read {record}: ")
    record.write_text(json.dumps({**built, "tests": {"per_test": {"test_a": "flaky"}}}))
    assert "has verdicts flaky" in run().stderr
    record.write_text(json.dumps({**built, "tests": {**tests, "per_test": {"test_z": "failed"}}}))
    done = run()
    assert done.stderr.strip().endswith("does not define: not the build of this test file")
    record.write_text(json.dumps(built))
    done = run("--only-failed-in", str(tmp_path / "other.json"))
    assert done.returncode != 0 and "is the --only-failed-in one" in done.stderr
    done = run("--patched-log", str(tmp_path / "build.log"))
    assert done.returncode != 0 and "not allowed with argument" in done.stderr


def test_cuda_qmv_launch_variant_specs_and_their_one_line_errors() -> None:
    """--variant NAME=constants: six numbers give wide layers the same tiles and stages,
    nine set each; other counts, non-numbers, bad or taken names are one-line exits."""
    bench = load_script("bench/cuda_qmv.py")
    assert bench.launch_variant("t2=2,2,16,8,8192,4", {}) == (
        "t2",
        [2, 2, 16, 8, 8192, 4, 8191, 2, 2],
    )
    nine = [1, 4, 16, 8, 8192, 4, 11008, 2, 3]
    assert bench.launch_variant("w=" + ",".join(map(str, nine)), {}) == ("w", nine)
    for bad, why in [("v=1,4,16", "give NAME="), ("v=1,4,16,8,8192,x", "give NAME="),
                     ("v", "give NAME="), ("a-b=1,4,16,8,8192,4", "give NAME="),
                     ("stock=1,4,16,8,8192,4", "is taken"),
                     ("t2=1,4,16,8,8192,4", "is taken")]:  # fmt: skip
        with pytest.raises(SystemExit, match=why) as exc:
            bench.launch_variant(bad, {"t2": nine})
        assert "\n" not in str(exc.value)


def test_cuda_qmv_template_variant_specs_and_their_one_line_errors(tmp_path: Path) -> None:
    """--template-variant NAME=DIFF[:constants]: the constants are what follows the last
    ':' when it is six or nine numbers (a path may hold ':'; six give wide layers the same
    tiles and stages); names of the arms or of another variant, and specs without a diff,
    are one-line exits."""
    bench = load_script("bench/cuda_qmv.py")
    assert bench.template_variant("v=a:b.diff:1,4,16,8,8192,4", {}) == (
        "v", Path("a:b.diff"), [1, 4, 16, 8, 8192, 4, 8191, 1, 4],
    )  # fmt: skip
    nine = [1, 4, 16, 8, 8192, 4, 8192, 2, 2]
    assert bench.template_variant("v=b.diff:" + ",".join(map(str, nine)), {})[2] == nine
    assert bench.template_variant("v=a:b.diff", {}) == ("v", Path("a:b.diff"), None)
    assert bench.template_variant("v=b.diff:1,4", {})[2] is None  # not six: part of the path
    for bad, why in [("v", "give NAME=DIFF"), ("=b.diff", "give NAME=DIFF"),
                     ("shipped=b.diff", "is taken"), ("st5=b.diff", "is taken")]:  # fmt: skip
        with pytest.raises(SystemExit, match=why) as exc:
            bench.template_variant(bad, {"st5": [1, 4, 16, 8, 8192, 4]})
        assert "\n" not in str(exc.value)
    # A diff that is missing, or does not apply, is one line too (no clone needed: it fails
    # before anything is rendered).
    with pytest.raises(SystemExit, match="no diff at") as exc:
        bench.rendered_qmv(lambda path: "", tmp_path / "missing.diff")
    bad = tmp_path / "bad.diff"
    bad.write_text("--- a/templates/nowhere.j2\n+++ b/templates/nowhere.j2\n@@ -1 +1 @@\n-a\n+b\n")
    with pytest.raises(SystemExit, match="does not apply to this checkout's templates") as exc:
        bench.rendered_qmv(lambda path: "", bad)
    assert "\n" not in str(exc.value)


def test_cuda_qmv_compare_shapes_and_their_one_line_errors() -> None:
    """``compare --shapes`` takes the layers a page asks about; a shape no launch can take
    (K off a step, N off a tile) is refused before a GPU is touched."""
    bench = load_script("bench/cuda_qmv.py")
    assert bench.shapes_arg("8192x16896, 4096x4096") == ((8192, 16896), (4096, 4096))
    for bad in ("8192", "8192x100", "100x4096", "0x16", "8192x16896,"):
        with pytest.raises(argparse.ArgumentTypeError, match="give KxN") as exc:
            bench.shapes_arg(bad)
        assert "\n" not in str(exc.value)


def test_mlx_tests_page_shows_no_hosts_paths() -> None:
    """The page's command keeps every option but shows interpreters and folders as
    placeholders and files by name; a page re-made from its JSON says the same."""
    bench = load_script("bench/mlx_tests.py")
    args = ["run", "--stock", "python3:/opt/stock/site", "--patched-log", "/tmp/cr/build.log",
            "--tests=/tmp/cr/tests", "--json", "/tmp/cr/t.json", "--shards", "8",
            "--only-failed-in", "/tmp/cr/build/build-cuda.json", "--only", "test_a"]  # fmt: skip
    shown = bench.generic_command(args)
    assert shown == (
        "python3 bench/mlx_tests.py run --stock STOCK_PYTHON[:SITE] --patched-log "
        "BUILD/build.log --tests=MLX/python/tests --json t.json --shards 8 "
        "--only-failed-in build-cuda.json --only test_a"
    )
    assert "/tmp" not in shown and "/opt" not in shown
    assert bench.generic_command(shlex.split(shown)[2:]) == shown  # as `report` re-makes it
    # compare's --stock and --patched are output files: their names, not placeholders.
    compared = bench.generic_command(["compare", "--stock", "/a/stock.out", "--patched", "p"])
    assert compared == "python3 bench/mlx_tests.py compare --stock stock.out --patched p"


def test_qmm_sm90_probe_tells_a_wrong_kernel_from_a_right_one(tmp_path, monkeypatch) -> None:
    """The probe's line on MLX's CPU backend (right) and on a kernel that writes zeros
    (wrong, the control); and its cases reach ``qmm_sm90`` (K = group) but the controls."""
    mx = pytest.importorskip("mlx.core")
    probe = load_script("bench/qmm_sm90_probe.py")
    controls = [c for c in probe.CASES + probe.MORE if c[3] != c[4]]
    assert controls and all(c[3] == 2 * c[4] for c in controls)
    case = ("float16", 8, 64, 128, 128, 4, 0, False)
    right = probe.line(probe.measure(mx, str(tmp_path), case))
    assert "rows_off=0[]" in right and "unwritten=0" in right and "runs_disagree=0e+00" in right
    assert float(right.split("err/std=")[1].split()[0]) < probe.OFF
    monkeypatch.setattr(mx, "quantized_matmul", lambda x, *a: mx.zeros((*x.shape[:-1], 64)))
    wrong = probe.line(probe.measure(mx, str(tmp_path), case))
    assert "rows_off=8[0, 1, 2]" in wrong and "cols_off=64[0, 1, 2]" in wrong


def test_qmm_sm90_probe_page_puts_the_arms_side_by_side(tmp_path) -> None:
    """The page reads what ``run`` printed (a run cut off keeps its cases), counts each
    arm's wrong cases and those that compiled a ``qmm_sm90`` module, and marks each wrong
    cell; a right case is the control. Output of anything else is refused."""
    probe = load_script("bench/qmm_sm90_probe.py")
    case, control = probe.CASES[0], next(c for c in probe.CASES if c[3] == 2 * c[4])

    def found(key: tuple, rows_off: list[int], jit: list[str], unwritten: bool = False) -> str:
        err = float("nan") if unwritten else 2.0 if rows_off else 1e-3
        return probe.line({**dict(zip(probe.FIELDS, key, strict=True)), "err_over_std": err,
                           "tf32_err_over_std": err, "rows_off": rows_off, "cols_off": [],
                           "runs_disagree": 0.0, "unwritten": unwritten, "jit": jit})  # fmt: skip

    def arm(mlx: str, *lines: str) -> Path:
        head = f"MLX {mlx} on Device(gpu, 0); packages: mlx=={mlx}; GPU: NVIDIA H100 80GB HBM3"
        path = tmp_path / f"{mlx}.txt"
        path.write_text("\n".join([head, *lines]) + "\n")
        return path

    sm90, sm80 = "qmm_sm90_tn_float16_n128_b4_g128_affine", "qmm_sm80_tn_float16_m32_b4_g128"
    stock = arm("0.32.1", found(case, [], [sm90], unwritten=True), found(control, [], [sm80]),
                found(probe.CASES[1], [0, 1, 2, 5], []))  # fmt: skip
    build = arm("0.32.1+patchkit.abc", found(case, [], [sm80]))  # cut off after one case
    runs = [probe.parse_run(stock.read_text()), probe.parse_run(build.read_text())]
    probe.page(runs, tmp_path / "probe")
    text = (tmp_path / "probe.md").read_text()
    assert "- Hardware: NVIDIA H100 80GB HBM3." in text
    assert "--out docs/results/probe`." in text  # every header named its GPU: no --hardware
    assert "Arm 1 (MLX 0.32.1): 2 of the 3 cases run wrong (1 with the first call's" in text
    assert "- Arm 1, stock MLX: MLX 0.32.1 " in text and "- Arm 2, a patchkit build: " in text
    assert "1 cases compiled a `qmm_sm90` module, 1 of them wrong." in text
    assert "1 of the 19 cases of `--full` (the run was cut off)" in text
    assert "Arm 2 (MLX 0.32.1+patchkit.abc): 0 of the 1 cases run wrong" in text
    row = next(r for r in text.splitlines() if r.startswith(f"| float16 | {case[1]} | 128 |"))
    assert "| nan, nan, n/a, yes, 0.0e+00, yes **wrong** | 1.0e-03, 1.0e-03, 0 of 8, no," in row
    assert "4 of 32, no, 0.0e+00, no **wrong** | not run |" in text
    control_row = next(r for r in text.splitlines() if f"| {control[3]} |" in r)
    assert "**wrong**" not in control_row and control_row.endswith("| not run |")
    assert json.loads((tmp_path / "probe.json").read_text())["runs"][0]["cases"][0][
        "err_over_std"] is None  # fmt: skip
    # the control: other output is refused, with the line it could not read
    with pytest.raises(ValueError, match="no header line"):
        probe.parse_run("Traceback (most recent call last):\n")
    with pytest.raises(ValueError, match="not a case line"):
        probe.parse_run(stock.read_text() + "Killed\n")


def test_qmm_sm90_probe_page_is_what_its_json_gives(tmp_path) -> None:
    """The committed probe page is ``page`` of the runs its JSON keeps: nothing on it was
    edited by hand, and an edit of the renderer that changes it shows here."""
    probe = load_script("bench/qmm_sm90_probe.py")
    committed = ROOT / "docs" / "results" / "qmm-sm90-probe"
    record = json.loads(committed.with_suffix(".json").read_text())
    probe.page(record["runs"], tmp_path / committed.name, "; ".join(record["hardware"]))
    assert (tmp_path / f"{committed.name}.md").read_text() == committed.with_suffix(
        ".md"
    ).read_text()


class _OffBy:
    """MLX with every quantized_matmul output scaled by ``1 + rel``: a kernel that is
    wrong by that much."""

    def __init__(self, mx: object, rel: float) -> None:
        self._mx, self._rel = mx, rel

    def __getattr__(self, name: str) -> object:
        return getattr(self._mx, name)

    def quantized_matmul(self, *args: object) -> object:
        return self._mx.quantized_matmul(*args) * (1 + self._rel)


def test_mlx_qmv_m1_error_is_against_float32_and_the_same_data_in_every_arm() -> None:
    """On MLX's CPU: a layer is drawn the same each time (both arms measure one); in
    float32 the kernel and the reference agree, and a kernel off by 1 % reads 1 %."""
    mx = pytest.importorskip("mlx.core")
    bench = load_script("bench/mlx_qmv.py")
    (q, x), (q2, x2) = (bench.layer(mx, 512, 96, 4, mx.float32, 64) for _ in range(2))
    assert all(mx.array_equal(a, b).item() for a, b in zip([*q, x], [*q2, x2], strict=True))
    other, _ = bench.layer(mx, 512, 96, 8, mx.float32, 64)
    assert not mx.array_equal(other[1], q[1]).item()  # another layer: other weights
    assert bench.m1_error(mx, q, x, 64, 4) < 1e-6
    assert 0.0099 < bench.m1_error(_OffBy(mx, 0.01), q, x, 64, 4) < 0.0101


def test_mlx_qmv_page_puts_m1_errors_beside_stocks(tmp_path) -> None:
    """Runs that measured M = 1's error get its section, the PR over stock per kind; runs
    that did not, none."""
    bench = load_script("bench/mlx_qmv.py")
    run = _mlx_qmv_report(stock_us=50.0, pr_us=20.0, nbytes=40_000_000, copy=4e12)
    run.update(rounds=3, repeats=200, mlx={"stock": "0.32.1", "pr": "0.32.1+patchkit.abc"},
               hardware={"gpu": "NVIDIA H200, 580", "cpus": 16}, command="c")  # fmt: skip
    build = {"backend": "cuda", "wheel_version": "0.32.1+patchkit.abc",
             "build_inputs_sha256": "f" * 64}  # fmt: skip
    bench.page([run], tmp_path / "plain", [], build)
    assert "M = 1 against a float32 reference" not in (tmp_path / "plain.md").read_text()
    run["rows"][0].update(stock_m1_error=4e-3, pr_m1_error=3e-3)
    bench.page([run], tmp_path / "errors", [], build)
    text = (tmp_path / "errors.md").read_text()
    assert "## M = 1 against a float32 reference" in text
    assert "| bfloat16 | 64 | 4 | 1 | 3.0e-03 | 4.0e-03 | 0.75 |" in text


def test_mlx_qmv_counts_the_verdicts_the_rounds_could_turn() -> None:
    """A verdict by the medians may differ from one round's: the page counts the cells
    that meet but miss in some round and the misses that meet in some round, each
    round's PR time against stock's of the same round. Rows whose every round agrees
    with the median are the control; runs with one round give no line."""
    bench = load_script("bench/mlx_qmv.py")

    def row(M: int, pr: list[float], stock: list[float]) -> dict:
        return {"K": 4096, "N": 4096, "bits": 4, "M": M, "bytes": 1, "floor_us": 1.0,
                "pr_us": sorted(pr)[1], "stock_us": sorted(stock)[1],
                "pr_rounds_us": pr, "stock_rounds_us": stock}  # fmt: skip

    rows = [
        row(2, [10.0, 11.0, 12.0], [40.0, 40.0, 40.0]),  # meets in every round
        row(2, [18.0, 19.0, 25.0], [40.0, 40.0, 40.0]),  # meets (0.475); round 3: 0.625
        row(3, [24.0, 25.0, 26.0], [40.0, 60.0, 40.0]),  # misses (0.625); round 2: 0.42
        row(4, [30.0, 30.0, 30.0], [40.0, 40.0, 40.0]),  # misses in every round
        row(12, [9.0, 10.0, 11.0], [20.0, 20.0, 20.0]),  # M = 9..16: meets throughout
    ]
    line = bench.rounds_line([{"rows": rows}])[0]
    assert ("M = 2..8: PR / stock: 1 of the 2 that meet it miss it in some round, "
            "1 of the 2 that miss it meet it in some round") in line  # fmt: skip
    # A target with no miss says nothing of misses; one with no rows is not named.
    assert "M = 9..16: PR / stock: 0 of the 1 that meet it miss it in some round;" not in line
    assert line.endswith("M = 9..16: PR / stock: 0 of the 1 that meet it miss it in some round.")
    assert "M = 1" not in line
    # Pairing is by round: stock's slow round 2 (60 us) turns only PR's round 2.
    assert bench.round_verdicts("ratio", 0.5, rows[2]) == [False, True, False]
    one_round = [{**r, "pr_rounds_us": r["pr_rounds_us"][:1],
                  "stock_rounds_us": r["stock_rounds_us"][:1]} for r in rows]  # fmt: skip
    assert bench.rounds_line([{"rows": one_round}]) == []
