"""ci/macos.yml cannot run here; it must at least parse and run the steps docs/apple.md promises."""

from __future__ import annotations

from pathlib import Path

import yaml

from patchkit.carry import pin

WORKFLOW = Path(__file__).resolve().parents[1] / "ci" / "macos.yml"


def load() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def runs(job: dict) -> list[str]:
    return [s["run"] for s in job["steps"] if "run" in s]


def test_workflow_parses_with_one_arm64_job() -> None:
    wf = load()
    (job,) = wf["jobs"].values()
    assert job["runs-on"] == "macos-14"
    # PyYAML reads the bare key `on` as True (YAML 1.1); GitHub reads it as "on".
    assert "workflow_dispatch" in wf[True]


def test_steps_run_in_the_documented_order() -> None:
    (job,) = load()["jobs"].values()
    cmds = runs(job)
    wanted = [
        "python -m pip install -e '.[test]'",
        "patchkit apply --pin 9a795735",
        "patchkit build --backend metal",
        "patchkit parity --quick --out parity.json",
        "patchkit bench --quick --out bench.json",
    ]
    assert cmds == wanted
    upload = next(
        s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact")
    )
    assert upload["if"] == "always()"
    paths = upload["with"]["path"].split()
    assert {"parity.json", "bench.json"} <= set(paths)


def test_patched_parity_gates_the_job_and_bench_still_runs() -> None:
    # The patched build streams affine and fp modes alike: a differing row is a
    # bug, so the parity step must fail the job; bench still records its numbers.
    (job,) = load()["jobs"].values()
    parity_step = next(s for s in job["steps"] if s.get("run", "").startswith("patchkit parity"))
    bench_step = next(s for s in job["steps"] if s.get("run", "").startswith("patchkit bench"))
    assert "continue-on-error" not in parity_step
    assert bench_step["if"] == "always()"


def test_pin_in_workflow_is_the_pinned_commit() -> None:
    (job,) = load()["jobs"].values()
    apply = next(c for c in runs(job) if c.startswith("patchkit apply"))
    pinned = pin.load(WORKFLOW.parents[1] / pin.PIN_FILE).commit
    assert pinned.startswith(apply.split("--pin ")[1])


def test_header_states_the_generation_13_caveat() -> None:
    head = WORKFLOW.read_text().split("\nname:")[0]
    assert "generation 13" in head and "qmv_wide" in head and "per-vector qmv" in head
