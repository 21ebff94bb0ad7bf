"""bench/qmm_sm90_layout.py: reading each compiler's layout, the verdict and its controls,
the committed page, and a one-line exit without the tools. No compiler runs here: the
PTX is shaped as NVRTC writes it (the committed page is the compilers' own output)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support_scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = load_script("bench/qmm_sm90_layout.py")
PAGE = ROOT / "docs" / "results" / "qmm-sm90-layout"
HOST = dict(zip(LAYOUT.FIELDS, (128, 128, 2304, 128, 128, 1280, 2048, 2088), strict=True))
JIT = dict(zip(LAYOUT.FIELDS, (64, 128, 1664, 64, 64, 896, 1472, 1512), strict=True))


def _ptx_bytes(values: list[int]) -> str:
    data = b"".join(v.to_bytes(8, "little") for v in values)
    return f".global .align 8 .b8 patchkit_layout[{len(data)}] = {{{', '.join(map(str, data))}}};"


def test_the_layout_array_reads_as_words_or_as_their_bytes() -> None:
    values = list(JIT.values())
    assert LAYOUT.parse_layout("x\n" + _ptx_bytes(values) + "\ny") == JIT
    words = f".global .align 8 .u64 patchkit_layout[8] = {{{', '.join(map(str, values))}}};"
    assert LAYOUT.parse_layout(words) == JIT
    with pytest.raises(ValueError):
        LAYOUT.parse_layout(".global .align 8 .b8 other[8] = {1, 0, 0, 0, 0, 0, 0, 0};")


def test_the_kernels_param_line_loses_its_mangled_name() -> None:
    ptx = (
        ".visible .entry _ZN7cutlass13device_kernelIN3mlxEEEvNT_6ParamsE(\n"
        "\t.param .align 64 .b8 _ZN7cutlass13device_kernelIN3mlxEEEvNT_6ParamsE_param_0[1664]\n"
        ")\n"
    )
    entry = "_ZN7cutlass13device_kernelIN3mlxEEEvNT_6ParamsE"
    assert LAYOUT.parse_param(ptx, entry) == ".param .align 64 .b8 param_0[1664]"
    with pytest.raises(ValueError):
        LAYOUT.parse_param(ptx, "_Zother")


def test_the_verdict_holds_only_with_both_controls_as_they_must_be() -> None:
    arms = {"host": {"layout": HOST}, "nvrtc": {"layout": JIT},
            "host_at_64": {"layout": JIT}, "nvrtc_at_128": {"layout": HOST}}  # fmt: skip
    v = LAYOUT.verdict(arms)
    assert v["host_and_nvrtc_agree"] is False and v["controls_as_they_must_be"] is True
    # A control that does not move the layout it must (alignment is not the only cause).
    v = LAYOUT.verdict({**arms, "host_at_64": {"layout": HOST}})
    assert v["controls_as_they_must_be"] is False
    assert v["controls"]["host with CUtensorMap at 64 lays Params out as nvrtc"] is False
    v = LAYOUT.verdict({**arms, "nvrtc": {"layout": HOST}, "host_at_64": {"layout": HOST}})
    assert v["host_and_nvrtc_agree"] is True


def test_the_committed_page_is_its_json_and_its_verdict_follows_from_its_layouts() -> None:
    report = json.loads(PAGE.with_suffix(".json").read_text())
    assert report["verdict"] == LAYOUT.verdict(report["arms"])
    assert PAGE.with_suffix(".md").read_text() == LAYOUT.page(report)
    assert report["verdict"]["controls_as_they_must_be"]
    assert "/tmp" not in report["command"] and "--nvrtc" not in report["command"]


def test_the_command_shown_drops_host_paths(tmp_path: Path) -> None:
    shown = LAYOUT.shown_command(
        ["--mlx-repo", "/srv/mlx", "--nvrtc=/opt/x/libnvrtc.so.13", "--cutlass", "/c",
         "--json", str(ROOT / "docs/results/qmm-sm90-layout.json"), f"--md={tmp_path}/p.md"]
    )  # fmt: skip
    assert shown == (
        "python3 bench/qmm_sm90_layout.py --json docs/results/qmm-sm90-layout.json --md p.md"
    )


def test_missing_tools_are_one_line_and_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "qmm_sm90_layout.py"), "--nvcc",
         str(tmp_path / "no-nvcc")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("qmm_sm90_layout: ")
