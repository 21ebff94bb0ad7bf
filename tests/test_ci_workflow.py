"""ci/macos.yml cannot run here: its job graph is checked instead.

MLX's own build_and_test.yml is the model: GitHub-hosted macOS runners have no Metal
device, so they only build; a ``[self-hosted, macos]`` runner with an Apple GPU runs
what needs one, from the artifacts the build uploaded. The graph test checks that
chain: each job's runner, what it needs, that every artifact a job downloads is one
the job it needs uploads (matrix names expanded), that no command needing a Metal
device runs on a hosted runner, and that the workflow builds the pinned commit.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
import yaml
from support_scripts import load_script

from patchkit.carry import pin

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / "ci" / "macos.yml"
# Commands that need a Metal device (parity, benchmarks, MLX's GPU tests).
GPU_ONLY = ("patchkit parity", "patchkit bench", "unittest", "_bench.py")
MATRIX_REF = re.compile(r"\$\{\{\s*matrix\.([\w-]+)\s*\}\}")


def _combos(job: dict) -> list[dict[str, str]]:
    """Every matrix combination of ``job`` (``include`` entries added), or one empty one."""
    matrix = dict((job.get("strategy") or {}).get("matrix") or {})
    include = matrix.pop("include", [])
    axes = list(matrix)
    product = [
        dict(zip(axes, values, strict=True)) for values in itertools.product(*matrix.values())
    ]
    return [{k: str(v) for k, v in c.items()} for c in product + include] or [{}]


def _artifacts(job: dict, action: str) -> set[str]:
    """Names of the artifacts ``job`` uploads or downloads, over its whole matrix."""
    names = set()
    for step in job["steps"]:
        if not step.get("uses", "").startswith(f"actions/{action}-artifact"):
            continue
        for combo in _combos(job):
            names.add(MATRIX_REF.sub(lambda m, c=combo: c[m[1]], step["with"]["name"]))
    return names


def test_job_graph() -> None:
    wf = yaml.safe_load(WORKFLOW.read_text())
    jobs = wf["jobs"]
    # export (ubuntu) -> build (hosted macOS: Apple's toolchain, no Metal device)
    # -> gpu (self-hosted, an Apple GPU).
    assert {name: job.get("needs") for name, job in jobs.items()} == {
        "export": None,
        "build": "export",
        "gpu": "build",
    }
    assert jobs["export"]["runs-on"].startswith("ubuntu-")
    assert jobs["build"]["runs-on"].startswith("macos-")
    assert jobs["gpu"]["runs-on"] == ["self-hosted", "macos"]
    for name, job in jobs.items():
        if job.get("needs"):
            missing = _artifacts(job, "download") - _artifacts(jobs[job["needs"]], "upload")
            assert not missing, (name, missing)
        if "self-hosted" not in job["runs-on"]:
            for step in job["steps"]:
                assert not any(g in step.get("run", "") for g in GPU_ONLY), (name, step)
    # The build is of the pinned commit, and the patched tree gets the exported patch.
    assert wf["env"]["PIN"] == pin.load(ROOT / pin.PIN_FILE).commit
    assert any('checkout --detach "$PIN"' in s.get("run", "") for s in jobs["build"]["steps"])
    assert any(" am " in s.get("run", "") for s in jobs["build"]["steps"])
    # PyYAML reads the bare key `on` as True (YAML 1.1); GitHub reads it as "on".
    assert "workflow_dispatch" in wf[True] and wf["permissions"] == {"contents": "read"}


def _gate():
    return load_script("ci/no_differing_rows.py")


@pytest.mark.parametrize(
    ("report", "code"),
    [
        ({"rows": [{"streamed": {"2": {"rows_differing": 0, "t": 1.0}}}]}, 0),
        ({"rows": [{"streamed": {"2": {"rows_differing": 3, "t": None}}}]}, 1),
        ({"results": [{"rows_match": True, "stock_rows_match": False}]}, 0),  # stock may differ
        ({"results": [{"rows_match": False, "stock_rows_match": False}]}, 1),
    ],
)
def test_differing_row_gate(tmp_path: Path, report: dict, code: int) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(report))
    assert _gate().main([str(path)]) == code
    assert _gate().main([str(tmp_path / "absent.json")]) == 1
