"""The parity gate's verdicts are kept per toolchain under the digest of everything they
depend on, and ``patchkit emulate``'s default matrix fills the same cache."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from patchkit.errors import UserError
from patchkit.verify.emulate import build, extract, suite
from patchkit.verify.emulate.families import AFFINE


@dataclass
class FakeResult:
    case: object


@dataclass
class FakeReport:
    toolchain: str
    patched: str
    results: list[FakeResult]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, tmp_path) -> list[tuple[str, str]]:
    """``suite.run`` replaced by a counter (the real suite runs minutes), judged "bad" when
    the patched text says so; a cache of this test's own."""
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[tuple[str, str]] = []

    def fake_run(sources, cases, toolchain, types=()):
        calls.append((sources.patched, toolchain.name))
        return FakeReport(toolchain.name, sources.patched, [FakeResult(c) for c in cases])

    def judged(report: FakeReport) -> suite.Verdict:
        bad = report.patched == "bad"
        return suite.Verdict(not bad, f"{report.toolchain} ran", ["row 3"] if bad else [])

    monkeypatch.setattr(suite, "run", fake_run)
    monkeypatch.setattr(suite, "toolchain_verdict", judged)
    return calls


def _gate_toolchains(n: int) -> list[str]:
    names = list(build.GATE)[:n]
    for name in names:
        try:
            build.require_compiler(build.TOOLCHAINS[name])
        except UserError as exc:
            pytest.skip(f"no compiler for the gate's toolchain: {exc}")
    return names


def test_a_verdict_is_reused_only_for_the_same_inputs(
    counted: list[tuple[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    names = _gate_toolchains(1)
    same = extract.Sources("upstream text", "patched text")
    first = suite.verify(AFFINE, same, toolchains=names)
    again = suite.verify(AFFINE, same, toolchains=names)
    assert counted == [("patched text", "gcc")] and again.summary == first.summary + suite.CACHED
    assert again.ok is first.ok is True
    # any input changed: run again; a failing verdict is kept as faithfully
    bad = extract.Sources("upstream text", "bad")
    assert suite.verify(AFFINE, bad, toolchains=names).failures == ["row 3"]
    assert suite.verify(AFFINE, bad, toolchains=names).failures == ["row 3"]
    suite.verify(AFFINE, same, quick=False, toolchains=names)
    monkeypatch.setattr(suite, "_emulator_digest", lambda: "another emulator")
    suite.verify(AFFINE, same, toolchains=names)
    assert [c[0] for c in counted] == ["patched text", "bad", "patched text", "patched text"]


def test_a_kept_toolchain_is_not_run_again_and_the_rest_are(
    counted: list[tuple[str, str]],
) -> None:
    """What ``patchkit emulate`` keeps (one toolchain's report, :func:`suite.keep_verdict`)
    answers the gate for that toolchain when it ran the gate's cases, in any order; the
    gate runs the others, and says so."""
    names = _gate_toolchains(2)
    same = extract.Sources("upstream text", "patched text")
    gate_cases = suite.default_matrix(suite.modes_of(AFFINE))
    ran = [FakeResult(c) for c in reversed(gate_cases)]  # the order a run ends in is its own
    suite.keep_verdict(AFFINE, same, (), FakeReport(names[0], "patched text", ran))
    # a report of other cases (one left out) is kept apart: the gate does not find it
    suite.keep_verdict(AFFINE, same, (), FakeReport(names[1], "patched text", ran[1:]))
    heard: list[str] = []
    verdict = suite.verify(AFFINE, same, toolchains=names, say=heard.append)
    assert counted == [("patched text", names[1])]
    assert heard == [f"parity: affine suite, {names[1]} (1 of 1 to run)"]
    assert verdict.ok and verdict.summary == f"{names[0]} ran{suite.CACHED}; {names[1]} ran"
    # another text: nothing kept for it, both run
    suite.verify(AFFINE, extract.Sources("upstream text", "other"), toolchains=names)
    assert counted[1:] == [("other", names[0]), ("other", names[1])]


def test_the_suite_says_each_toolchain_and_the_time_left(
    counted: list[tuple[str, str]],
) -> None:
    """A rebase's gate runs minutes the first time on a machine: each toolchain is announced,
    with the time left estimated from those done (none before the first is done)."""
    names = _gate_toolchains(3)
    heard: list[str] = []
    verdict = suite.verify(AFFINE, extract.Sources("u", "p"), toolchains=names, say=heard.append)
    assert verdict.ok and len(heard) == 3
    assert heard[0] == f"parity: affine suite, {names[0]} (1 of 3 to run)"
    assert heard[2].startswith(f"parity: affine suite, {names[2]} (3 of 3 to run), about ")
    assert heard[2].endswith(" s left")
