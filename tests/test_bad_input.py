"""Bad input ends in one line that names the file and what to do, never a traceback; under
--json the error is one JSON object on stdout, click's usage errors included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from patchkit.carry import pin, render, source
from patchkit.cli import main
from patchkit.errors import UserError
from patchkit.util import git

ROOT = Path(__file__).resolve().parents[1]
GOOD_PIN = (ROOT / "pin.toml").read_text()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace('commit = "9a7', "commit = 123 #"), "40-hex-digit commit id"),
        (lambda t: t.replace('release = "0.32.1"', 'release = "0.32.1\\n#x"'), "a version"),
        (lambda t: t + "\n\x00 = 1\n", "malformed"),
        (lambda t: t.replace("[upstream]", "[upstrem]"), "malformed"),
    ],
)
def test_malformed_pin_is_one_line(tmp_path: Path, edit, message: str) -> None:
    path = tmp_path / "pin.toml"
    path.write_text(edit(GOOD_PIN))
    with pytest.raises(UserError, match=message) as err:
        pin.load(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_pin_that_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "pin.toml").mkdir()
    with pytest.raises(UserError, match="it must be a file"):
        pin.load(tmp_path / "pin.toml")


def test_release_is_validated_before_it_reaches_generated_code() -> None:
    assert pin.check_release("0.32.1") == "0.32.1"
    with pytest.raises(UserError, match="not a version"):
        pin.check_release("0.32.1\n#include <evil>")


def _templates(tmp_path: Path, edits: str, snippet: bytes) -> Path:
    d = tmp_path / "templates" / "mlx" / "kernels" / "k.h"
    d.mkdir(parents=True)
    (d / "edits.toml").write_text(edits)
    (d / "s.j2").write_bytes(snippet)
    return tmp_path / "templates"


EDITS = 'backend = "metal"\n[[edit]]\nop = "append"\nanchor = ""\ntemplate = "s.j2"\n'


@pytest.mark.parametrize(
    ("edits", "snippet", "message"),
    [
        (EDITS + "[[[bad\n", b"x", "not valid TOML"),
        (EDITS.replace('backend = "metal"\n', ""), b"x", "missing or wrong entry"),
        (EDITS, b"{% if %}", r"s\.j2:1: Expected an expression"),
        (EDITS, b"{{ 1 | nosuchfilter }}", r"s\.j2:1: No filter named"),
        (EDITS, b"{% include 'nope.j2' %}", "template 'nope.j2' not found"),
        (EDITS, b"\xff\xfe", "not UTF-8"),
    ],
)
def test_template_errors_name_the_file(
    tmp_path: Path, edits: str, snippet: bytes, message: str
) -> None:
    templates = _templates(tmp_path, edits, snippet)
    with pytest.raises(UserError, match=message) as err:
        for plan in render.load_plans(templates):
            render.render_snippet(plan, "s.j2", {})
    assert "\n" not in str(err.value)


def test_cache_that_is_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(source.ENV_CACHE, str(blocker))
    with pytest.raises(UserError, match="set PATCHKIT_CACHE_DIR to a writable folder"):
        source.ensure_clone(str(tmp_path))


@pytest.mark.parametrize(
    "args",
    [
        ["emulate", "--bogus", "--json"],
        ["apply", "--json", "--pin"],
        ["parity", "--json", "--mode", "x"],
    ],
)
def test_usage_errors_are_json_under_json(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2
    payload = json.loads(r.stdout)
    assert payload["ok"] is False and payload["exit"] == 2 and payload["error"]
    assert "Traceback" not in r.output


def _repo_with_commits(path: Path, n: int) -> list[str]:
    """A repository with a chain of ``n`` commits, made by one ``git fast-import``.

    Author, date and contents are fixed, so the commit ids are the same on every run.
    """
    git.init(path)
    stream = []
    for i in range(n):
        message, content = f"c{i}\n", f"{i}\n"
        stream += [
            "commit refs/heads/main",
            f"mark :{i + 1}",
            "committer patchkit <patchkit@example.com> 1786924800 +0000",
            f"data {len(message)}\n{message}",
            *([f"from :{i}"] if i else []),
            f"M 100644 inline f\ndata {len(content)}\n{content}",
        ]
    git.run(path, "fast-import", "--quiet", input="\n".join(stream) + "\n")
    git.run(path, "checkout", "--quiet", "main")
    return git.out(path, "rev-list", "--reverse", "main").split()


def test_ambiguous_prefix_is_named_as_such(tmp_path: Path) -> None:
    # 600 commits: fixed ids in which some 4-digit prefix is shared (as in ~94% of
    # random sets), so the check below always has its ambiguous case.
    shas = _repo_with_commits(tmp_path / "r", 600)
    prefixes = [s[:4] for s in shas]
    twice = next(p for p in prefixes if prefixes.count(p) > 1)
    with pytest.raises(UserError, match="ambiguous"):
        source.resolve(tmp_path / "r", twice)
    unique = next(p for p in prefixes if prefixes.count(p) == 1)
    assert source.resolve(tmp_path / "r", unique) in shas


def test_vanished_local_source_uses_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(source.ENV_CACHE, str(tmp_path / "cache"))
    repo = tmp_path / "mlx"
    (sha,) = _repo_with_commits(repo, 1)
    spec = source.source_spec(str(repo))
    source.ensure_clone(spec)
    for f in sorted(repo.rglob("*"), reverse=True):
        f.rmdir() if f.is_dir() else f.unlink()
    repo.rmdir()
    said: list[str] = []
    clone = source.open_source(str(repo), progress=said.append)
    assert source.resolve(clone, sha) == sha
    assert any("no longer exists" in s for s in said)
    with pytest.raises(UserError, match="no such path"):
        source.source_spec(str(tmp_path / "never-cloned"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-K", "0", "-M", "0", "--bits", "7", "--group-size", "48"], "describe one case"),
        (["--kernel", "streamed", "-K", "512", "-N", "64", "-M", "1"], "at least 2"),
        (["--costs", "--kernel", "streamed", "-K", "512", "-N", "64"], "--costs reads every"),
    ],
)
def test_emulate_refuses_options_that_do_not_apply(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    r = CliRunner().invoke(main, ["emulate", *args, "--json"])
    assert r.exit_code == 1 and message in json.loads(r.stdout)["error"]


# The `patchkit` command's start, cut by Ctrl-C before the CLI module has been imported:
# argv[0] names the command, the package is imported, SIGINT arrives, then the CLI would be.
_EARLY_SIGINT = """
import os, signal, sys
sys.argv = [sys.argv[1] + "/patchkit", *sys.argv[2:]]
import patchkit
os.kill(os.getpid(), signal.SIGINT)
import patchkit.cli
print("never")
"""


def _default_sigint() -> None:
    """In a child: Ctrl-C as a terminal delivers it. A shell's background job starts with
    SIGINT ignored, and Python then installs no handler of its own."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "plain"])
def test_ctrl_c_while_starting_is_one_line_and_json(tmp_path: Path, as_json: bool) -> None:
    import subprocess
    import sys

    args = ["status", "--json"] if as_json else ["status"]
    r = subprocess.run([sys.executable, "-c", _EARLY_SIGINT, str(tmp_path), *args],
                       capture_output=True, text=True, timeout=60, check=False,
                       preexec_fn=_default_sigint)  # fmt: skip
    assert r.returncode == 130 and "never" not in r.stdout, r.stderr
    assert r.stderr.strip() == "patchkit: error: interrupted while starting; nothing was written"
    if as_json:
        assert json.loads(r.stdout) == {"ok": False, "error": r.stderr.strip()[17:],
                                        "kind": "KeyboardInterrupt", "exit": 130}  # fmt: skip
    else:
        assert r.stdout == ""


def test_importing_patchkit_as_a_library_leaves_ctrl_c_alone() -> None:
    """Control: imported by another program (argv[0] is not `patchkit`), Ctrl-C stays Python's
    KeyboardInterrupt, and the CLI hands it back once it parses its arguments."""
    import signal
    import subprocess
    import sys

    code = ("import signal, patchkit; "
            "print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True, preexec_fn=_default_sigint).stdout  # fmt: skip
    assert out.strip() == "True"
    import patchkit

    signal.signal(signal.SIGINT, patchkit._interrupted_while_starting)
    try:
        CliRunner().invoke(main, ["--version"])
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
