"""The parity gate's verdicts are kept under the digest of everything they depend on."""

from __future__ import annotations

import pytest

from patchkit.errors import UserError
from patchkit.verify.emulate import build, extract, suite
from patchkit.verify.emulate.families import AFFINE


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, tmp_path) -> list[str]:
    """``suite._verify`` replaced by a counter (the real suite runs minutes); a cache of
    this test's own."""
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[str] = []

    def fake(header, sources, types, *, quick, toolchains, say=None):
        calls.append(sources.patched)
        return suite.Verdict(sources.patched != "bad", f"ran {len(calls)}", [])

    monkeypatch.setattr(suite, "_verify", fake)
    return calls


def test_a_verdict_is_reused_only_for_the_same_inputs(
    counted: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    names = list(build.GATE)[:1]
    try:
        build.require_compiler(build.TOOLCHAINS[names[0]])
    except UserError as exc:
        pytest.skip(f"no compiler for the gate's toolchain: {exc}")
    same = extract.Sources("upstream text", "patched text")
    first = suite.verify(AFFINE, same, toolchains=names)
    again = suite.verify(AFFINE, same, toolchains=names)
    assert counted == ["patched text"] and again.summary == first.summary + suite.CACHED
    assert again.ok is first.ok is True
    # any input changed: run again; a failing verdict is kept as faithfully
    assert not suite.verify(AFFINE, extract.Sources("upstream text", "bad"), toolchains=names).ok
    assert not suite.verify(AFFINE, extract.Sources("upstream text", "bad"), toolchains=names).ok
    suite.verify(AFFINE, same, quick=False, toolchains=names)
    monkeypatch.setattr(suite, "_emulator_digest", lambda: "another emulator")
    suite.verify(AFFINE, same, toolchains=names)
    assert counted == ["patched text", "bad", "patched text", "patched text"]


def test_the_suite_says_each_toolchain_and_the_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebase's gate runs minutes the first time on a machine: each toolchain is announced,
    with the time left estimated from those done (none before the first is done)."""

    class Done:
        def failures(self) -> list[str]:
            return []

    monkeypatch.setattr(suite, "run", lambda *a, **k: Done())
    monkeypatch.setattr(suite, "control_failure", lambda report: None)
    monkeypatch.setattr(suite, "summarize", lambda report: {})
    monkeypatch.setattr(suite, "summary_line", lambda report, summary: "ok")
    heard: list[str] = []
    names = ["gcc", "clang", "gcc-fast"]
    verdict = suite._verify(AFFINE, extract.Sources("u", "p"), (), quick=True,
                            toolchains=names, say=heard.append)  # fmt: skip
    assert verdict.ok and len(heard) == 3
    assert heard[0] == "parity: affine suite, gcc (1 of 3)"
    assert heard[2].startswith("parity: affine suite, gcc-fast (3 of 3), about ")
    assert heard[2].endswith(" s left")
