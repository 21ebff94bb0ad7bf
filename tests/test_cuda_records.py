"""ci/cuda_records.py: every CUDA record of the patch in one run, copied only when whole.

The run itself needs a GPU host; here, its plan (the order the records depend on, and the
options each step gets), and what it copies into docs/results when steps succeed, record
failures, or leave no record, with commands that stand in for the real ones.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

import pytest

from patchkit.carry import render
from tests.support_procs import ends_within
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
    n = len(records.SPEED_RUNS)
    assert len(lines) == len(plan) == 10 + 2 * n
    apply, build, *timed, ncu, ncu_page, san_tests, sanitizer, tests, controls = plan
    speed, page, overlapped, overlapped_page = timed[:n], timed[n], timed[n + 1 : -1], timed[-1]
    # The build checks out the patch branch that apply makes in the cached clone.
    assert apply.argv[1:4] == ["-m", "patchkit", "apply"] and apply.produces == ()
    assert build.argv[1:5] == ["-m", "patchkit", "build", "--backend"]
    assert build.argv[-3:] == ["--offline", "-j", "16"]
    assert controls.argv[1] == "ci/cuda_controls.py" and controls.argv[-3:] == build.argv[-3:]
    # Every speed run times the venv of the build just made against the stock given.
    patched = {s.argv[s.argv.index("--patched") + 1] for s in speed}
    assert len(patched) == 1 and (patched_python := patched.pop()).endswith("venv/bin/python")
    assert all(s.argv[s.argv.index("--stock") + 1] == "python3:/opt/stock" for s in speed)
    assert {(s.argv[s.argv.index("--dtype") + 1], int(s.argv[s.argv.index("--group-size") + 1]))
            for s in speed} == set(records.SPEED_RUNS)  # fmt: skip
    assert page.argv[2] == "page" and all(str(p) in page.argv for s in speed for p in s.produces)
    assert page.argv[page.argv.index("--build-record") + 1] == str(build.produces[0])
    # The same runs again with calls MLX's graph may overlap, on a page of their own; the
    # first page's calls wait each for the one before.
    assert [s.argv[s.argv.index("--calls") + 1] for s in speed] == ["chained"] * n

    def but_json_and_calls(step) -> list[str]:
        drop = {step.argv.index("--json") + 1, len(step.argv) - 1}
        return [a for i, a in enumerate(step.argv) if i not in drop]

    assert [but_json_and_calls(s) for s in overlapped] == [but_json_and_calls(s) for s in speed]
    assert [s.argv[-1] for s in overlapped] == ["independent"] * n
    assert [s.produces[0].name for s in overlapped] == [
        "cuda-independent-" + s.produces[0].name.removeprefix("cuda-") for s in speed
    ]  # fmt: skip
    assert all(str(p) in overlapped_page.argv for s in overlapped for p in s.produces)
    assert {p.name for p in overlapped_page.produces} == {
        "cuda-independent.json", "cuda-independent.md", "cuda-independent.png",
    }  # fmt: skip
    assert overlapped_page.argv[overlapped_page.argv.index("--build-record") + 1] == str(
        build.produces[0]
    )
    # Nsight Compute profiles the same two arms; its page is that build's record too.
    arms = [b for a, b in itertools.pairwise(ncu.argv) if a == "--arm"]
    assert ncu.argv[1:3] == ["bench/mlx_ncu.py", "run"] and arms == [
        f"pr={patched_python}",
        "stock=python3:/opt/stock",
    ]
    assert ncu_page.argv[2] == "page" and str(ncu.produces[0]) in ncu_page.argv
    assert ncu_page.argv[ncu_page.argv.index("--build-record") + 1] == str(build.produces[0])
    assert {p.name for p in ncu_page.produces} == {"cuda-ncu.json", "cuda-ncu.md"}
    # compute-sanitizer on MLX's tests, the same two arms, before the controls replace the
    # build: its tests folder is the applied branch's, its page names the build's record.
    assert san_tests.argv[1:3] == ["bench/mlx_tests.py", "pr-tests"] and not san_tests.alongside
    folder = san_tests.argv[san_tests.argv.index("--out") + 1]
    assert sanitizer.argv[1:3] == ["bench/sanitizer_logs.py", "run"]
    assert [b for a, b in itertools.pairwise(sanitizer.argv) if a == "--arm"] == arms
    assert sanitizer.argv[sanitizer.argv.index("--tests") + 1] == folder
    assert sanitizer.argv[sanitizer.argv.index("--build-record") + 1] == str(build.produces[0])
    assert {p.name for p in sanitizer.produces} == {
        "cuda-sanitizer-runs.json", "cuda-sanitizer-runs.md",
    } and sanitizer.recorded_failure == (1,)  # fmt: skip
    # What the build's test run failed, on the stock given, beside that run's own output
    # (the build's log) and with the test file it ran, both kept before the controls
    # rebuild: it runs beside them.
    assert tests.argv[1:3] == ["bench/mlx_tests.py", "run"] and tests.alongside
    assert not any(s.alongside for s in plan if s is not tests)
    assert tests.argv[tests.argv.index("--only-failed-in") + 1] == str(build.produces[0])
    # MLX's own methods the series fixes run on stock too, failed on the build or not.
    named = [b for a, b in itertools.pairwise(tests.argv) if a == "--only"]
    assert named[:3] == ["test_qmm", "test_qmv", "test_qmv_wide"]
    # And the series' new tests: each shown failing on stock, as MLX asks of a new test.
    assert named[3:] == render.pr_test_methods()
    assert "test_qmv_tensor_cores_match_single_vector" in named
    kept = {src.name if src.name == "build.log" else "tests": str(dst) for src, dst in build.keep}
    assert tests.argv[tests.argv.index("--patched-log") + 1] == kept["build.log"]
    assert tests.argv[tests.argv.index("--tests") + 1] == kept["tests"]
    assert {src.parts[-2:] for src, _ in build.keep} >= {("python", "tests")}
    assert "--patched" not in tests.argv  # the build the controls replace is never imported
    # Stock compiles its JIT kernels from nothing: its few methods get every core.
    assert tests.argv[tests.argv.index("--shards") + 1] == str(records.STOCK_SHARDS)
    assert tests.argv[tests.argv.index("--jobs") + 1] == str(os.cpu_count() or 1)
    assert "--deadline-s" not in tests.argv  # the build's tests had no time limit either
    for limit in (["--test-timeout", "600"], ["--test-timeout=600"]):
        bounded = records.steps("python3", Path("/tmp/cr"), limit, sys.executable)[-2]
        assert bounded.argv[bounded.argv.index("--deadline-s") + 1] == "600"


def _fake_steps(records, out: Path, exits: dict[str, int], skip: str = "",
                before: dict[str, str] | None = None, in_turn: bool = False):  # fmt: skip
    """Each step runs ``before``'s code for it, writes its records (not ``skip``'s) and
    exits as ``exits`` says; what the build keeps is a file the fake build writes. With
    ``in_turn``, no step runs beside others."""
    original = records.steps
    kept = out / "cache" / "build.log"

    def steps(stock, out_dir, build_args, python, pr_record=None, patched=None, rounds=None):
        real = original(stock, out_dir, build_args, python, pr_record, patched, rounds)
        fake = []
        for s in real:
            files = [str(p) for p in s.produces if s.name != skip]
            if s.name == "build":
                files.append(str(kept))
            code = (f"import sys, time, pathlib\n{(before or {}).get(s.name, '')}\n"
                    f"for f in map(pathlib.Path, {files!r}):\n"
                    "    f.parent.mkdir(parents=True, exist_ok=True)\n"
                    f"    f.write_text('new {s.name}')\n"
                    f"sys.exit({exits.get(s.name, 0)})")  # fmt: skip
            keep = tuple((kept, out_dir / "build" / dst.name) for _, dst in s.keep)
            beside = s.alongside and not in_turn
            fake.append(records.Step(s.name, [python, "-c", code], s.produces,
                                     s.recorded_failure, keep, beside))  # fmt: skip
        return fake

    kept.parent.mkdir(parents=True, exist_ok=True)
    return steps


@pytest.fixture
def results(tmp_path: Path, monkeypatch):
    records = _records()
    dest = tmp_path / "results"
    dest.mkdir()
    (dest / "build-cuda.json").write_text("old")
    monkeypatch.setattr(records, "RESULTS", dest)
    # The ncu step's profiler is looked for before anything runs: these runs have one.
    monkeypatch.setattr(records.proc, "cuda_tool", lambda name, given=None: f"/opt/cuda/{name}")
    # And their stock runs on the GPU (its probe: test_a_stock_not_on_the_gpu_is_refused...).
    monkeypatch.setattr(records, "mlx_not_on_gpu", lambda spec, version=None: None)
    return records, dest


def test_a_whole_run_copies_every_record_and_no_run_file(results, tmp_path: Path,
                                                         monkeypatch, capsys) -> None:  # fmt: skip
    records, dest = results
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, {}))
    monkeypatch.chdir(tmp_path)  # a relative --out: the speed runs still stay out
    assert records.main(["--stock", "python3", "--out", "out"]) == 0
    # Each step run in turn says how long it took (the one beside the others does not).
    timed = [ln for ln in capsys.readouterr().out.splitlines() if ln.endswith(" s")]
    assert [ln.split(":")[1].split(" took ")[0].strip() for ln in timed] == [
        s.name for s in records.steps("python3", tmp_path, [], "python3") if not s.alongside
    ]
    assert sorted(p.name for p in dest.iterdir()) == [
        "build-cuda.json", "build-cuda.md", "cuda-controls.json", "cuda-controls.md",
        "cuda-independent.json", "cuda-independent.md", "cuda-independent.png",
        "cuda-ncu.json", "cuda-ncu.md", "cuda-sanitizer-runs.json", "cuda-sanitizer-runs.md",
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


def test_the_tests_step_runs_beside_the_controls_and_is_waited_for(
    results, tmp_path: Path, monkeypatch
) -> None:
    """It starts before the controls and ends after them (it waits for a file the controls
    write): the run waits for it, then copies its record; the build's log was kept for it."""
    records, dest = results
    started = tmp_path / "controls-started"
    before = {"controls": f"pathlib.Path({str(started)!r}).write_text('x')",
              "tests beside stock": f"p = pathlib.Path({str(started)!r})\n"
              "end = time.time() + 8\nwhile not p.exists() and time.time() < end:\n"
              "    time.sleep(0.05)\np.exists() or sys.exit(9)"}  # fmt: skip
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, {}, before=before))
    out = tmp_path / "out"
    assert records.main(["--stock", "python3", "--out", str(out)]) == 0
    assert (dest / "cuda-tests.json").read_text() == "new tests beside stock"
    assert (out / "build" / "build.log").read_text() == "new build"
    # Control: run in its turn, it waits for controls that have not started, and fails.
    started.unlink()
    for f in dest.iterdir():
        f.write_text("old")
    steps = _fake_steps(records, tmp_path, {}, before=before, in_turn=True)
    monkeypatch.setattr(records, "steps", steps)
    assert records.main(["--stock", "python3", "--out", str(tmp_path / "out2")]) == 2
    assert (dest / "cuda-tests.json").read_text() == "old"


def test_a_failing_step_stops_what_runs_beside_it(results, tmp_path: Path, monkeypatch) -> None:
    """The controls fail while the tests step still runs: the run ends (2), copies nothing
    and leaves no process of its own running, the tests step's children included."""
    records, dest = results
    pid, child = tmp_path / "pid", tmp_path / "child"
    write_pid = (f"import os, subprocess\nc = subprocess.Popen([sys.executable, '-c', "
                 f"'import time; time.sleep(60)'])\n"
                 f"pathlib.Path({str(child)!r}).write_text(str(c.pid))\n"
                 f"pathlib.Path({str(pid)!r}).write_text(str(os.getpid()))")  # fmt: skip
    before = {"tests beside stock": write_pid + "\ntime.sleep(60)",
              "controls": f"p = pathlib.Path({str(pid)!r})\nend = time.time() + 20\n"
              "while not p.exists() and time.time() < end: time.sleep(0.05)"}  # fmt: skip
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, {"controls": 3},
                                                      before=before))  # fmt: skip
    start = time.monotonic()
    assert records.main(["--stock", "python3", "--out", str(tmp_path / "out")]) == 2
    assert time.monotonic() - start < 40  # not the tests step's 60 s
    assert [p.name for p in dest.iterdir()] == ["build-cuda.json"]
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid.read_text()), 0)
    assert _gone(int(child.read_text())), "the tests step's child outlived the run"


def _gone(pid: int) -> bool:
    """Whether ``pid`` ends within 2 s; one that does not is killed, so that a failing
    test leaves nothing running."""
    if ends_within(pid):
        return True
    os.kill(pid, 9)
    return False


def _current_speed_page(records, dest: Path, inputs: str | None = None) -> None:
    """A speed page in ``dest`` of this checkout's build inputs (or of ``inputs``)."""
    from patchkit.carry import mlx_build, pin

    short = pin.load(records.ROOT / pin.PIN_FILE).short
    want = inputs or mlx_build.build_inputs_id(records.ROOT, short, "cuda")
    (dest / "cuda.json").write_text(json.dumps({"build": {"build_inputs_sha256": want}}))


def test_skip_speed_keeps_a_current_page_and_runs_the_rest(
    results, tmp_path: Path, monkeypatch, capsys
) -> None:
    records, dest = results
    _current_speed_page(records, dest)
    kept = (dest / "cuda.json").read_text()
    assert records.main(["--plan", "--skip", "speed", "--stock", "python3"]) == 0
    plan = capsys.readouterr().out
    # Its runs and page are gone; the overlapped calls' are a page of their own.
    assert "# skipped: speed" in plan and "bench/mlx_qmv.py page" in plan
    timed = [ln for ln in plan.splitlines() if "bench/mlx_qmv.py" in ln]
    assert timed and all("independent" in ln for ln in timed)
    assert "patchkit build" in plan and "ci/cuda_controls.py" in plan
    assert "bench/mlx_ncu.py run" in plan  # speed's own steps only
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, {}))
    assert records.main(["--skip", "speed", "--stock", "python3", "--out",
                         str(tmp_path / "out")]) == 0  # fmt: skip
    assert (dest / "cuda.json").read_text() == kept  # the page as it was
    assert not (dest / "cuda.md").exists()  # nor any other file of the skipped steps
    assert (dest / "build-cuda.json").read_text() == "new build"
    assert (dest / "cuda-controls.json").read_text() == "new controls"


@pytest.mark.parametrize("page", ["missing", "other inputs"])
def test_skip_refuses_a_page_that_is_not_current(
    results, tmp_path: Path, monkeypatch, capsys, page: str
) -> None:
    """A skipped page of other build inputs would stand beside a build it did not time."""
    records, dest = results
    if page == "other inputs":
        _current_speed_page(records, dest, inputs="0" * 64)
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, {}))
    argv = ["--skip", "speed", "--stock", "python3", "--out", str(tmp_path / "out")]
    assert records.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("cuda_records: --skip speed: ") and err.count("\n") == 1, err
    assert ("does not exist" if page == "missing" else "is of build inputs 0000") in err
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        ["build-cuda.json"] + (["cuda.json"] if page != "missing" else [])
    )
    assert (dest / "build-cuda.json").read_text() == "old"
    # Control: the same run without --skip makes every page.
    assert records.main(argv[2:]) == 0 and (dest / "cuda.md").read_text() == "new speed page"


@pytest.mark.parametrize("kind", ["ncu", "sanitizer"])
def test_skip_ncu_or_sanitizer_reads_the_build_its_page_ran(results, kind: str) -> None:
    """The Nsight Compute and compute-sanitizer pages name their build as the speed page
    does (``build``); a sanitizer page made without ``--build-record`` names none."""
    records, dest = results
    page = dest / records.SKIPPABLE[kind]
    assert "does not exist" in records.not_current(kind)
    _current_speed_page(records, dest)
    page.write_text((dest / "cuda.json").read_text())
    if kind == "ncu":
        assert records.not_current(kind) is None
    page.write_text(json.dumps({"build": {"build_inputs_sha256": "0" * 64}}))
    assert "is of build inputs 0000" in records.not_current(kind)
    page.write_text(json.dumps({"runs": []}))
    assert "is of build inputs None" in records.not_current(kind)
    if kind == "sanitizer":  # and the tests it ran are the PR's as they render now
        from patchkit.carry import mlx_build

        build = json.loads((dest / "cuda.json").read_text())["build"]
        page.write_text(json.dumps({"build": build, "pr_files_sha256": "0" * 64}))
        assert "ran other PR tests" in records.not_current(kind)
        current = mlx_build.pr_files_id(records.ROOT)
        page.write_text(json.dumps({"build": build, "pr_files_sha256": current}))
        assert records.not_current(kind) is None


def test_skip_controls_needs_their_page_of_this_control_diff(results) -> None:
    records, dest = results
    from patchkit.carry import mlx_build, pin

    want = mlx_build.build_inputs_id(records.ROOT, pin.load(records.ROOT / pin.PIN_FILE).short,
                                     "cuda")  # fmt: skip
    page = {"build_inputs_sha256": want, "control_sha256": "0" * 64, "ok": True}
    (dest / "cuda-controls.json").write_text(json.dumps(page))
    assert "another control diff" in records.not_current("controls")
    page["control_sha256"] = records.cuda_controls.control_sha256()
    (dest / "cuda-controls.json").write_text(json.dumps(page))
    assert records.not_current("controls") is None
    (dest / "cuda-controls.json").write_text(json.dumps({**page, "ok": False}))
    assert "did not come out as it must" in records.not_current("controls")


def test_only_makes_those_pages_on_a_build_without_tests(results, tmp_path: Path, monkeypatch,
                                                        capsys) -> None:  # fmt: skip
    """``--only``: the build runs without MLX's tests and its record stays in the run's
    folder (a build record comes with its tests); only the pages named are copied."""
    records, dest = results
    assert records.main(["--plan", "--only", "speed", "--stock", "python3"]) == 0
    plan = capsys.readouterr().out
    build = next(ln for ln in plan.splitlines() if "patchkit build" in ln)
    assert build.endswith("--no-test") and "bench/mlx_qmv.py page" in plan
    assert "mlx_tests.py" not in plan and "cuda_controls.py" not in plan and "mlx_ncu" not in plan
    assert "# then: copy cuda.json, cuda.md, cuda.png into " in plan
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, {}))
    out = tmp_path / "out"
    assert records.main(["--only", "speed", "--only", "ncu", "--stock", "python3",
                         "--out", str(out)]) == 0  # fmt: skip
    assert sorted(p.name for p in dest.iterdir()) == [
        "build-cuda.json", "cuda-ncu.json", "cuda-ncu.md", "cuda.json", "cuda.md", "cuda.png",
    ]  # fmt: skip
    assert (dest / "build-cuda.json").read_text() == "old"  # the test-less build's stays out
    assert (out / "build" / "build-cuda.json").read_text() == "new build"
    assert not (dest / "cuda-tests.json").exists()


def test_only_tests_compares_the_committed_build_record_with_stock(
    results, tmp_path: Path, monkeypatch, capsys
) -> None:
    """``--only tests``: the PR's test folder from the applied branch, no build; the tests
    beside stock take the PR's arm from the committed build record, which must be of this
    checkout's build inputs and PR tests and hold a test run, and run beside the controls
    (after their build); only their page is copied, the record stays as it was."""
    records, dest = results
    from patchkit.carry import mlx_build, pin

    short = pin.load(records.ROOT / pin.PIN_FILE).short
    current = {"patch": {"build_inputs_sha256": mlx_build.build_inputs_id(records.ROOT, short,
                                                                          "cuda"),
                         "pr_files_sha256": mlx_build.pr_files_id(records.ROOT)},
               "tests": {"per_test": {"test_qmv": "passed"}}}  # fmt: skip
    argv = ["--only", "tests", "--only", "controls", "--stock", "python3"]
    # Refused, with the reason, while the record cannot be the PR's arm.
    for record, why in (("old", "is not JSON"), ("[]", "is not a record"),
                        ({**current, "tests": None}, "no run of MLX's"),
                        ({**current, "patch": {}}, "is of build inputs None")):  # fmt: skip
        (dest / "build-cuda.json").write_text(record if isinstance(record, str) else
                                              json.dumps(record))  # fmt: skip
        assert records.main(["--plan", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("cuda_records: --only tests: ") and why in err, err
        assert err.count("\n") == 1
    (dest / "build-cuda.json").write_text(json.dumps(current))
    kept = (dest / "build-cuda.json").read_text()
    assert records.main(["--plan", *argv]) == 0
    plan = capsys.readouterr().out
    lines = plan.splitlines()
    build = next(i for i, ln in enumerate(lines) if "patchkit build" in ln)
    pr_tests = next(i for i, ln in enumerate(lines) if "bench/mlx_tests.py pr-tests" in ln)
    tests = next(i for i, ln in enumerate(lines) if "bench/mlx_tests.py run" in ln)
    assert lines[build].endswith("--no-test") and "ci/cuda_controls.py" in plan
    controls = next(i for i, ln in enumerate(lines) if "ci/cuda_controls.py" in ln)
    assert pr_tests < build < tests < controls  # beside the controls, not the build
    assert lines[pr_tests].endswith(f"--out {lines[tests].split('--tests ')[1].split()[0]}")
    assert f"--patched-record {dest / 'build-cuda.json'}" in lines[tests]
    assert "--patched-log" not in lines[tests] and "--only-failed-in" not in lines[tests]
    assert "# then keep: " not in plan  # nothing of the build: its tests' folder not needed
    assert "# then: copy cuda-tests.json, cuda-tests.md, cuda-controls.json, " in plan
    # The tests alone build nothing.
    assert records.main(["--plan", "--only", "tests", "--stock", "python3"]) == 0
    alone = capsys.readouterr().out
    assert "patchkit build" not in alone and "bench/mlx_tests.py pr-tests" in alone
    # Control: without --only tests, the run's own build is the PR's arm again.
    full = records.steps("python3", tmp_path / "o", [], sys.executable)
    assert "--patched-log" in next(s for s in full if s.name == "tests beside stock").argv
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, {}))
    out = tmp_path / "out"
    assert records.main([*argv, "--out", str(out)]) == 0
    assert sorted(p.name for p in dest.iterdir()) == [
        "build-cuda.json", "cuda-controls.json", "cuda-controls.md", "cuda-tests.json",
        "cuda-tests.md",
    ]  # fmt: skip
    assert (dest / "build-cuda.json").read_text() == kept
    assert (dest / "cuda-tests.json").read_text() == "new tests beside stock"
    assert (out / "build" / "tests" / "test_quantized.py").read_text() == "new pr tests"


def test_rounds_go_to_the_speed_runs_alone(capsys) -> None:
    """``--rounds N`` reaches every speed run (both pages), and no other step; without it
    the runs take the bench's own count (the control); a count under 1 is refused."""
    records = _records()
    argv = ["--plan", "--stock", "python3:/opt/stock", "--out", "/tmp/cr"]
    assert records.main([*argv, "--rounds", "2"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
    runs = [ln for ln in lines if "bench/mlx_qmv.py run" in ln]
    assert len(runs) == 2 * len(records.SPEED_RUNS)
    assert all(" --rounds 2 --calls " in ln for ln in runs)
    assert not [ln for ln in lines if "--rounds" in ln and ln not in runs]
    assert records.main(argv) == 0
    assert "--rounds" not in capsys.readouterr().out
    assert records.main([*argv, "--rounds", "0"]) == 2
    assert capsys.readouterr().err == "cuda_records: --rounds 0: give 1 or more\n"


def test_patched_times_the_committed_build_records_wheel_without_a_build(
    results, tmp_path: Path, monkeypatch, capsys
) -> None:
    """``--patched``: the speed and ncu steps time an MLX built by an earlier run, named by
    the committed build record (this checkout's build inputs, its wheel_version), with no
    apply and no build; only their pages are copied, the record stays as it was. Refused,
    in one line, with other steps or a record that cannot name that build."""
    records, dest = results
    from patchkit.carry import mlx_build, pin

    short = pin.load(records.ROOT / pin.PIN_FILE).short
    inputs = mlx_build.build_inputs_id(records.ROOT, short, "cuda")
    current = {"patch": {"build_inputs_sha256": inputs}, "wheel_version": "0.32.1+patchkit.a"}
    spec = "/opt/pr/python:/opt/pr/site"
    argv = ["--only", "speed", "--only", "ncu", "--stock", "python3", "--patched", spec]
    (dest / "build-cuda.json").write_text(json.dumps(current))
    refusal = "cuda_records: --patched goes with --only speed, independent, ncu, sanitizer alone"
    for bad in (["--only", "controls"], [], ["--only", "speed", "--only", "tests"]):
        assert records.main(["--plan", *bad, "--stock", "python3", "--patched", spec]) == 2
        err = capsys.readouterr().err
        assert err.startswith(refusal) and err.count("\n") == 1, err
    for record, why in (("old", "is not JSON"), ({**current, "patch": {}}, "is of build inputs"),
                        ({"patch": current["patch"]}, "names no wheel_version")):  # fmt: skip
        (dest / "build-cuda.json").write_text(record if isinstance(record, str) else
                                              json.dumps(record))  # fmt: skip
        assert records.main(["--plan", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("cuda_records: --patched: ") and why in err and err.count("\n") == 1
    (dest / "build-cuda.json").write_text(json.dumps(current))
    kept = (dest / "build-cuda.json").read_text()
    assert records.main(["--plan", *argv]) == 0
    plan = capsys.readouterr().out.splitlines()
    # nothing that reads the applied branch either: a host with the wheel has none
    assert not [ln for ln in plan if "patchkit build" in ln or "patchkit apply" in ln
                or "pr-tests" in ln]  # fmt: skip
    runs = [ln for ln in plan if "bench/mlx_qmv.py run" in ln]
    assert len(runs) == len(records.SPEED_RUNS) and all(f"--patched {spec} " in ln for ln in runs)
    pages = [ln for ln in plan if " page " in ln]
    assert len(pages) == 2 and all(ln.endswith(f"--build-record {dest / 'build-cuda.json'}")
                                   for ln in pages)  # fmt: skip
    assert any(f"--arm pr={spec} " in ln for ln in plan if "bench/mlx_ncu.py run" in ln)
    # Control: the same pages without --patched build and time that build.
    assert records.main(["--plan", *argv[:-2]]) == 0
    built = capsys.readouterr().out
    assert "patchkit build" in built and f"--patched {spec}" not in built
    assert f"--build-record {dest / 'build-cuda.json'}" not in built
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, {}))
    out = tmp_path / "out"
    assert records.main([*argv, "--out", str(out)]) == 0
    assert sorted(p.name for p in dest.iterdir()) == [
        "build-cuda.json", "cuda-ncu.json", "cuda-ncu.md", "cuda.json", "cuda.md", "cuda.png",
    ]  # fmt: skip
    assert (dest / "build-cuda.json").read_text() == kept
    assert not (out / "build" / "build-cuda.json").exists()  # nothing was built


def test_only_sanitizer_runs_the_tool_on_the_pr_tests_of_the_applied_branch(
    results, capsys
) -> None:
    """``--only sanitizer``: the tests folder comes from the branch ``apply`` leaves, with a
    build (without MLX's tests) or, with ``--patched``, the committed record's wheel and no
    build; either way the page names the build its PR arm ran."""
    records, dest = results
    from patchkit.carry import mlx_build, pin

    short = pin.load(records.ROOT / pin.PIN_FILE).short
    inputs = mlx_build.build_inputs_id(records.ROOT, short, "cuda")
    current = {"patch": {"build_inputs_sha256": inputs}, "wheel_version": "0.32.1+patchkit.a"}
    (dest / "build-cuda.json").write_text(json.dumps(current))
    spec = "/opt/pr/python:/opt/pr/site"
    argv = ["--plan", "--only", "sanitizer", "--stock", "python3", "--out", "/tmp/cr"]
    for patched in ([], ["--patched", spec]):
        assert records.main([*argv, *patched]) == 0
        plan = [ln for ln in capsys.readouterr().out.splitlines() if not ln.startswith("#")]
        tools = [ln.split()[1] if "bench/" in ln else " ".join(ln.split()[1:4]) for ln in plan]
        built = ["-m patchkit build"] if not patched else []
        assert tools == ["-m patchkit apply", *built, "bench/mlx_tests.py",
                         "bench/sanitizer_logs.py"]  # fmt: skip
        run = plan[-1]
        record = dest / "build-cuda.json" if patched else Path("/tmp/cr/build/build-cuda.json")
        assert run.endswith(f"--build-record {record}") and "--arm stock=python3 " in run
        assert (f"--arm pr={spec} " in run) == bool(patched)
        assert "--tests /tmp/cr/bench/sanitizer-tests " in run
        if not patched:
            assert plan[1].endswith("--no-test")


def test_a_patched_mlx_of_another_wheel_is_refused_before_anything_runs(
    results, tmp_path: Path, monkeypatch, capsys
) -> None:
    """The probe holds the patched MLX to the build record's wheel_version: another build
    (or stock) would put the record's name on pages of something else."""
    records, dest = results
    probe = _records().mlx_not_on_gpu
    for name in ("other", "cpu", "stock"):
        (tmp_path / name).mkdir()
    other = _fake_python(tmp_path / "other", "0.32.1+patchkit.b Device(gpu, 0)")
    assert "is not the build record's 0.32.1+patchkit.a" in probe(other, "0.32.1+patchkit.a")
    assert probe(other, "0.32.1+patchkit.b") is None  # control: its own version passes
    cpu = _fake_python(tmp_path / "cpu", "0.32.1+patchkit.a Device(cpu, 0)")
    assert "does not run on the GPU" in probe(cpu, "0.32.1+patchkit.a")
    monkeypatch.setattr(records, "mlx_not_on_gpu", probe)
    from patchkit.carry import mlx_build, pin

    short = pin.load(records.ROOT / pin.PIN_FILE).short
    (dest / "build-cuda.json").write_text(json.dumps({
        "patch": {"build_inputs_sha256": mlx_build.build_inputs_id(records.ROOT, short, "cuda")},
        "wheel_version": "0.32.1+patchkit.a"}))  # fmt: skip
    stock = _fake_python(tmp_path / "stock", "0.32.1 Device(gpu, 0)")
    out = tmp_path / "out"
    assert records.main(["--only", "speed", "--stock", stock, "--patched", other,
                         "--out", str(out)]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert err.startswith(f"cuda_records: --patched {other}: MLX 0.32.1+patchkit.b is not")
    assert err.count("\n") == 1 and not out.exists()


def test_only_and_skip_together_are_a_one_line_error(results, capsys) -> None:
    records, dest = results
    assert records.main(["--only", "speed", "--skip", "ncu", "--stock", "python3"]) == 2
    err = capsys.readouterr().err
    assert err == "cuda_records: --only and --skip do not go together\n"
    assert [p.name for p in dest.iterdir()] == ["build-cuda.json"]


def test_no_profiler_stops_the_run_before_its_build(results, tmp_path: Path, monkeypatch,
                                                    capsys) -> None:  # fmt: skip
    """Without ncu the run would build and time for half an hour, then copy nothing."""
    records, dest = results
    monkeypatch.setattr(records.proc, "cuda_tool", lambda name, given=None: None)
    ran = tmp_path / "ran"
    before = {"apply": f"pathlib.Path({str(ran)!r}).write_text('x')"}
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, {}, before=before))
    assert records.main(["--stock", "python3", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("cuda_records: no Nsight Compute")
    assert not ran.exists() and [p.name for p in dest.iterdir()] == ["build-cuda.json"]
    # Control: a run that makes no ncu page needs none.
    assert records.main(["--only", "speed", "--stock", "python3", "--out",
                         str(tmp_path / "out2")]) == 0 and ran.exists()  # fmt: skip


def _fake_python(folder: Path, output: str, code: int = 0) -> str:
    """An interpreter that answers any program with ``output`` and exit ``code``."""
    fake = folder / "python"
    fake.write_text(f"#!/bin/sh\necho '{output}'\nexit {code}\n")
    fake.chmod(0o755)
    return str(fake)


def test_a_stock_not_on_the_gpu_is_refused_before_anything_runs(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """The mlx wheel without mlx-cuda runs on the CPU: its pages would not be CUDA's."""
    records = _records()
    cpu = _fake_python(tmp_path, "0.32.1 Device(cpu, 0)")
    assert "does not run on the GPU" in records.mlx_not_on_gpu(cpu)
    assert "does not import" in records.mlx_not_on_gpu(
        _fake_python(tmp_path, "ModuleNotFoundError: No module named 'mlx'", 1)
    )
    assert "cannot run" in records.mlx_not_on_gpu(str(tmp_path / "missing"))
    # Control: a stock on the GPU passes, also where its teardown aborts after the line.
    assert records.mlx_not_on_gpu(_fake_python(tmp_path, "0.32.1 Device(gpu, 0)")) is None
    assert records.mlx_not_on_gpu(_fake_python(tmp_path, "0.32.1 Device(gpu, 0)", 134)) is None
    # The run refuses it with one line before its first step (nothing is written).
    monkeypatch.setattr(records.proc, "cuda_tool", lambda name, given=None: f"/opt/cuda/{name}")
    cpu = _fake_python(tmp_path, "0.32.1 Device(cpu, 0)")
    out = tmp_path / "out"
    assert records.main(["--stock", cpu, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cuda_records: --stock {cpu}: MLX 0.32.1 Device(cpu, 0) does not")
    assert err.count("\n") == 1 and not out.exists()  # no step made its folders
    # Without --out, the temporary folder made for the run is gone again.
    monkeypatch.setattr(records.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert records.main(["--stock", cpu]) == 2
    assert not list((tmp_path / "tmp").iterdir())


def test_sigterm_ends_the_run_and_what_runs_beside_it(results, tmp_path: Path, monkeypatch) -> None:
    """SIGTERM (a time limit, ``kill``) ends the run as Ctrl-C does: the step beside, in a
    process group of its own that a signal to the run's group does not reach, is stopped
    with its children; nothing is copied; the handlers are the caller's again after."""
    import signal
    import threading

    records, dest = results
    pid, child = tmp_path / "pid", tmp_path / "child"
    spawn = (f"import os, subprocess\nc = subprocess.Popen([sys.executable, '-c', "
             f"'import time; time.sleep(60)'])\n"
             f"pathlib.Path({str(child)!r}).write_text(str(c.pid))\n"
             f"pathlib.Path({str(pid)!r}).write_text(str(os.getpid()))\n"
             "time.sleep(60)")  # fmt: skip
    # The step in the run's own group gets SIGTERM first: time to end through its cleanup.
    termed = tmp_path / "termed"
    on_term = (f"import signal\nsignal.signal(signal.SIGTERM, lambda *_: (pathlib.Path("
               f"{str(termed)!r}).write_text('yes'), sys.exit(3)))\ntime.sleep(60)")  # fmt: skip
    before = {"tests beside stock": spawn, "controls": on_term}
    monkeypatch.setattr(records, "steps", _fake_steps(records, tmp_path, {}, before=before))

    def terminate_once_started() -> None:
        end = time.monotonic() + 20
        while not (pid.exists() and pid.read_text()) and time.monotonic() < end:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    mine = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=terminate_once_started, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(SystemExit) as ended:
        records.main(["--stock", "python3", "--out", str(tmp_path / "out")])
    assert ended.value.code == 128 + signal.SIGTERM
    assert time.monotonic() - start < 40  # not the steps' 60 s
    assert signal.getsignal(signal.SIGTERM) is mine
    assert [p.name for p in dest.iterdir()] == ["build-cuda.json"]
    for process in (int(pid.read_text()), int(child.read_text())):
        assert _gone(process), f"process {process} of the step beside outlived the run"
    assert termed.read_text() == "yes"  # the foreground step ended through its handler


def test_stock_is_asked_for_only_where_a_step_runs_it(results, tmp_path: Path, monkeypatch,
                                                      capsys) -> None:  # fmt: skip
    """The controls need no stock MLX; the speed, ncu and tests steps do (a one-line error
    before anything runs, nothing left behind)."""
    records = _records()
    assert records.main(["--plan", "--only", "controls"]) == 0
    plan = capsys.readouterr().out
    assert "ci/cuda_controls.py" in plan and "--stock" not in plan
    monkeypatch.setattr(records.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    for argv in (["--plan"], ["--only", "tests"], ["--only", "controls", "--only", "speed"]):
        assert records.main(argv) == 2
        err = capsys.readouterr().err
        assert (
            err == "cuda_records: --stock PYTHON[:SITE] is needed for the speed, independent, "
            "ncu, sanitizer and tests steps\n"
        )
    assert not list((tmp_path / "tmp").iterdir())
