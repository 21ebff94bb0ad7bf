"""ci/cuda_records.py: every CUDA record of the patch in one run, copied only when whole.

The run itself needs a GPU host; here, its plan (the order the records depend on, and the
options each step gets), and what it copies into docs/results when steps succeed, record
failures, or leave no record, with commands that stand in for the real ones.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support_scripts import load_script


def _records():
    return load_script("ci/cuda_records.py")


def test_plan_builds_first_times_that_build_and_runs_the_controls_last(capsys) -> None:
    records = _records()
    assert records.main(["--plan", "--stock", "python3:/opt/stock", "--offline", "-j", "16",
                         "--out", "/tmp/cr"]) == 0  # fmt: skip
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    plan = records.steps("python3:/opt/stock", Path("/tmp/cr"), ["--offline", "-j", "16"],
                         sys.executable)  # fmt: skip
    assert len(lines) == len(plan) == 5 + len(records.SPEED_RUNS)
    apply, build, *speed, page, tests, controls = plan
    # The build checks out the patch branch that apply makes in the cached clone.
    assert apply.argv[1:4] == ["-m", "patchkit", "apply"] and apply.produces == ()
    assert build.argv[1:5] == ["-m", "patchkit", "build", "--backend"]
    assert build.argv[-3:] == ["--offline", "-j", "16"]
    assert controls.argv[1] == "ci/cuda_controls.py" and controls.argv[-3:] == build.argv[-3:]
    # Every speed run times the venv of the build just made against the stock given.
    patched = {s.argv[s.argv.index("--patched") + 1] for s in speed}
    assert len(patched) == 1 and patched.pop().endswith("venv/bin/python")
    assert all(s.argv[s.argv.index("--stock") + 1] == "python3:/opt/stock" for s in speed)
    assert {(s.argv[s.argv.index("--dtype") + 1], int(s.argv[s.argv.index("--group-size") + 1]))
            for s in speed} == set(records.SPEED_RUNS)  # fmt: skip
    assert page.argv[2] == "page" and all(str(p) in page.argv for s in speed for p in s.produces)
    assert page.argv[page.argv.index("--build-record") + 1] == str(build.produces[0])
    # What the build's test run failed, again on that build beside the stock given.
    assert tests.argv[1:3] == ["bench/mlx_tests.py", "run"]
    assert tests.argv[tests.argv.index("--only-failed-in") + 1] == str(build.produces[0])
    assert tests.argv[tests.argv.index("--patched") + 1] == speed[0].argv[
        speed[0].argv.index("--patched") + 1]  # fmt: skip
    assert tests.argv[tests.argv.index("--tests") + 1].endswith("python/tests")
    assert "--deadline-s" not in tests.argv  # the build's tests had no time limit either
    for limit in (["--test-timeout", "600"], ["--test-timeout=600"]):
        bounded = records.steps("python3", Path("/tmp/cr"), limit, sys.executable)[-2]
        assert bounded.argv[bounded.argv.index("--deadline-s") + 1] == "600"


def _fake_steps(records, out: Path, exits: dict[str, int], skip: str = ""):
    """Each step writes its records (not ``skip``'s) and exits as ``exits`` says."""
    original = records.steps

    def steps(stock, out_dir, build_args, python):
        real = original(stock, out_dir, build_args, python)
        fake = []
        for s in real:
            files = [str(p) for p in s.produces if s.name != skip]
            code = (f"import sys\nfor f in {files!r}: open(f, 'w').write('new {s.name}')\n"
                    f"sys.exit({exits.get(s.name, 0)})")  # fmt: skip
            fake.append(records.Step(s.name, [python, "-c", code], s.produces,
                                     s.recorded_failure))  # fmt: skip
        return fake

    return steps


@pytest.fixture
def results(tmp_path: Path, monkeypatch):
    records = _records()
    dest = tmp_path / "results"
    dest.mkdir()
    (dest / "build-cuda.json").write_text("old")
    monkeypatch.setattr(records, "RESULTS", dest)
    return records, dest


def test_a_whole_run_copies_every_record_and_no_run_file(results, tmp_path: Path,
                                                         monkeypatch) -> None:  # fmt: skip
    records, dest = results
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, {}))
    monkeypatch.chdir(tmp_path)  # a relative --out: the speed runs still stay out
    assert records.main(["--stock", "python3", "--out", "out"]) == 0
    assert sorted(p.name for p in dest.iterdir()) == [
        "build-cuda.json", "build-cuda.md", "cuda-controls.json", "cuda-controls.md",
        "cuda-tests.json", "cuda-tests.md", "cuda.json", "cuda.md", "cuda.png",
    ]  # fmt: skip
    assert (dest / "build-cuda.json").read_text() == "new build"


def test_recorded_failures_are_copied_and_reported(results, tmp_path: Path, monkeypatch) -> None:
    records, dest = results
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, {"controls": 1}))
    assert records.main(["--stock", "python3", "--out", str(tmp_path / "out")]) == 1
    assert (dest / "cuda-controls.json").read_text() == "new controls"


@pytest.mark.parametrize(("exits", "skip"), [({"speed bfloat16 group 64": 1}, ""),
                                             ({}, "speed page")])  # fmt: skip
def test_a_step_without_its_record_stops_the_run_and_copies_nothing(
    results, tmp_path: Path, monkeypatch, exits: dict[str, int], skip: str
) -> None:
    records, dest = results
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, exits, skip))
    assert records.main(["--stock", "python3", "--out", str(tmp_path / "out")]) == 2
    assert [p.name for p in dest.iterdir()] == ["build-cuda.json"]
    assert (dest / "build-cuda.json").read_text() == "old"


def test_an_out_folder_with_files_is_refused(results, tmp_path: Path, monkeypatch) -> None:
    """An earlier run's record in --out would pass for a step that wrote none."""
    records, dest = results
    out = tmp_path / "out"
    (out / "build").mkdir(parents=True)
    for name in ("build-cuda.json", "build-cuda.md"):
        (out / "build" / name).write_text("earlier run")
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, {}, skip="build"))
    assert records.main(["--stock", "python3", "--out", str(out)]) == 2
    assert (dest / "build-cuda.json").read_text() == "old"
