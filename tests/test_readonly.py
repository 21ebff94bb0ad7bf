"""Read-only is read-only, and every failure is one line that names the path or revision.

``check`` and ``status`` never fetch or move a ref; with ``patches/`` gone they say
"stale"; bad sources and roots are named with what to do; ``--json`` answers in JSON
on errors and interrupts too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from patchkit import cli
from patchkit.carry import apply, check, source
from patchkit.errors import UserError
from patchkit.util import git

pytest_plugins = ("support_git",)
DATE = "2026-08-20T00:00:00+00:00"


def refs(repo: Path) -> str:
    return git.out(repo, "for-each-ref", "--format=%(refname) %(objectname)")


def cli_args(env: dict, *args: str) -> list[str]:
    return [*args, "--root", str(env["root"]), "--templates", str(env["templates"])]


def test_check_never_fetches_a_pin_missing_from_the_cache(env: dict, tmp_path: Path) -> None:
    apply.apply(env["old"], root=env["root"], templates_dir=env["templates"])
    # A second cache whose clone predates the pin: the clone lacks the pinned commit.
    monkey_cache = tmp_path / "cache2"
    old_repo = tmp_path / "older"
    git.init(old_repo)
    (old_repo / "f").write_text("x\n")
    git.add(old_repo, ["f"])
    git.commit(old_repo, "before the pin", date=DATE)
    clone = source.ensure_clone(str(old_repo), root=monkey_cache)
    assert git.try_rev_parse(clone, env["old"]) is None
    shutil.rmtree(old_repo)
    shutil.copytree(env["path"], old_repo)  # the source now has the pin: a fetch would find it
    before = refs(clone)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("PATCHKIT_CACHE_DIR", str(monkey_cache))
        with pytest.raises(UserError, match=r"not in patchkit's cached clone .* does not fetch"):
            check.check(root=env["root"], mlx_repo=str(old_repo), templates_dir=env["templates"])
    assert refs(clone) == before and git.try_rev_parse(clone, env["old"]) is None


@pytest.mark.parametrize("command", ["check", "status"])
def test_deleted_patches_is_stale_not_a_traceback(env: dict, command: str) -> None:
    apply.apply(env["old"], root=env["root"], templates_dir=env["templates"])
    shutil.rmtree(env["root"] / "patches")
    res = CliRunner().invoke(cli.main, cli_args(env, command))
    assert res.exit_code == (1 if command == "check" else 0), res.output
    assert f"stale: patches/{env['old'][:8]}/ is missing" in res.output
    assert "Traceback" not in res.output and "No such file" not in res.output
    res = CliRunner().invoke(cli.main, cli_args(env, command, "--json"))
    payload = json.loads(res.stdout)
    assert payload.get("missing", None) is True or payload.get("patches_current") is False


def test_root_that_does_not_exist_is_named(env: dict) -> None:
    for command in ("apply", "check", "status", "rebase"):
        args = [command, "--root", "/nonexistent/patchkit"] + (
            ["--to", "main"] if command == "rebase" else []
        )
        res = CliRunner().invoke(cli.main, [*args, "--json"])
        assert res.exit_code == 1
        payload = json.loads(res.stdout)
        assert "/nonexistent/patchkit" in payload["error"] and "no such folder" in payload["error"]


def test_first_apply_without_pin_names_the_file(env: dict) -> None:
    with pytest.raises(UserError, match=r"no .*pin\.toml yet: pass --pin REV"):
        apply.apply(None, root=env["root"], templates_dir=env["templates"])


def test_empty_source_and_source_lacking_the_pin_say_so(env: dict, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    git.init(empty)
    with pytest.raises(UserError, match=r"empty repository .* point --mlx-repo"):
        apply.apply(
            env["old"], root=env["root"], templates_dir=env["templates"], mlx_repo=str(empty)
        )
    other = tmp_path / "other"
    git.init(other)
    (other / "f").write_text("x\n")
    git.add(other, ["f"])
    git.commit(other, "unrelated", date=DATE)
    with pytest.raises(UserError, match=rf"'{env['old'][:12]}' is not a revision of {other}"):
        apply.apply(
            env["old"][:12], root=env["root"], templates_dir=env["templates"], mlx_repo=str(other)
        )


def test_unreachable_ssh_source_names_the_cause(env: dict) -> None:
    with pytest.raises(UserError) as caught:
        source.ensure_clone("ssh://git@nonexistent.invalid/mlx.git")
    message = str(caught.value)
    assert "cannot clone ssh://git@nonexistent.invalid/mlx.git" in message
    said = message.split("git said: ", 1)[1]
    assert not said.startswith("and the repository exists"), message
    assert "nonexistent.invalid" in said or "ssh" in said, message


def test_json_answers_on_interrupt_and_on_a_bug(env: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted(*args: object, **kw: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(apply, "apply", interrupted)
    res = CliRunner().invoke(cli.main, cli_args(env, "apply", "--json"))
    payload = json.loads(res.stdout)
    assert res.exit_code == 130 and payload["kind"] == "KeyboardInterrupt"
    assert payload["ok"] is False and "interrupted" in payload["error"]

    def bug(*args: object, **kw: object) -> None:
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(apply, "apply", bug)
    res = CliRunner().invoke(cli.main, cli_args(env, "apply", "--json"))
    assert json.loads(res.stdout)["kind"] == "ZeroDivisionError" and res.exit_code == 1
