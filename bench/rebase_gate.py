"""How long ``patchkit rebase`` takes, gate included, from a cold cache and after the
README's set-up (its ``patchkit emulate`` line, read from the README), for a bump that
changes no kernel text.

  PATCHKIT_MLX_REPO=/path/to/mlx python3 bench/rebase_gate.py run --to REV --json gate.json
  python3 bench/rebase_gate.py report gate.json

Each scenario runs in its own copy of this checkout (``git clone``) with its own
``PATCHKIT_CACHE_DIR``, so nothing of the user's is touched and no scenario warms another:

- cold: an empty cache; the rebase clones MLX, compiles every emulator library and runs
  the parity suites;
- after set-up: the README's ``patchkit emulate`` first (timed too), then the same rebase,
  which finds the suites' verdicts for the same kernel text, toolchain by toolchain.

The gate's own seconds come from the rebase's JSON (``gate_s``); the wall time is the
command's. Not a timed test: one run each, on whatever machine runs it, named on the page.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 180  # a bump that changes no kernel text, after the README's set-up


def _patchkit(args: list[str], cwd: Path, cache: Path) -> tuple[float, dict[str, Any]]:
    """Run ``patchkit ARGS --json`` there; (wall seconds, its JSON). Raises on failure."""
    env = {**os.environ, "PATCHKIT_CACHE_DIR": str(cache)}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "patchkit", *args, "--json"], cwd=cwd, env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"patchkit {' '.join(args)} failed ({done.returncode}): "
                         f"{done.stderr.strip()[-500:]}")  # fmt: skip
    return wall, json.loads(done.stdout)


def _kept(rec: dict[str, Any]) -> dict[str, Any]:
    """What the page keeps of a rebase's JSON: the verdicts, not this machine's paths."""
    return {
        "written": rec.get("written"),
        "parity": (rec.get("parity") or {}).get("summary"),
        "fp_parity": (rec.get("fp_parity") or {}).get("summary"),
    }


def setup_args(readme: Path = ROOT / "README.md") -> list[str]:
    """The arguments of the README's set-up ``patchkit emulate`` (what a user has run)."""
    found = re.search(r"\.venv/bin/patchkit (emulate[^\n`&;|]*)", readme.read_text())
    if not found:
        raise SystemExit(f"{readme}: no `.venv/bin/patchkit emulate` line in the set-up")
    return shlex.split(found.group(1))


def _checkout(into: Path) -> Path:
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(into)], check=True)
    return into


def run(to: str, out: Path) -> None:
    if not os.environ.get("PATCHKIT_MLX_REPO"):
        raise SystemExit("set PATCHKIT_MLX_REPO to a clone of MLX holding the pin and REV")
    scenarios = {}
    setup = setup_args()
    with tempfile.TemporaryDirectory(prefix="rebase-gate-") as tmp:
        base = Path(tmp)
        cold = _checkout(base / "cold")
        wall, rec = _patchkit(["rebase", "--to", to], cold, base / "cold-cache")
        scenarios["cold"] = {"wall_s": wall, "gate_s": rec.get("gate_s"), **_kept(rec)}
        warm = _checkout(base / "warm")
        setup_s, _ = _patchkit(setup, warm, base / "warm-cache")
        wall, rec = _patchkit(["rebase", "--to", to], warm, base / "warm-cache")
        scenarios["after set-up"] = {"wall_s": wall, "gate_s": rec.get("gate_s"),
                                     "setup_emulate_s": setup_s, **_kept(rec)}  # fmt: skip
    host = {
        "system": f"{platform.system()} {platform.machine()}",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    report = {
        "command": "python3 bench/rebase_gate.py run " + shlex.join(sys.argv[2:]),
        "to": to,
        "setup": "patchkit " + " ".join(setup),
        "host": host,
        "scenarios": scenarios,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(page(report))


def page(report: dict[str, Any]) -> str:
    host = report["host"]
    lines = [
        f"# `patchkit rebase --to {report['to']}`: how long, gate included",
        "",
        f"- Command: `{report['command']}`",
        f"- Host: {host['system']}, {host['cpus']} CPUs, Python {host['python']}",
        "- The bump changes no kernel text; each scenario has its own checkout copy and cache.",
        f"- Set-up step timed: `{report.get('setup', 'patchkit emulate')}` (the README's)",
        "",
        "| scenario | rebase wall s | gate s | set-up s |",
        "|---|---|---|---|",
    ]
    warm = report["scenarios"].get("after set-up")
    if warm:
        verdict = "met" if warm["wall_s"] <= TARGET_S else "missed"
        lines[-3:-3] = [f"- Target: the rebase after set-up within {TARGET_S} s (on a 2-core "
                        f"machine): {verdict} here ({warm['wall_s']:.0f} s)"]  # fmt: skip
    for name, s in report["scenarios"].items():
        gate = "" if s.get("gate_s") is None else f"{s['gate_s']:.0f}"
        setup = f"{s['setup_emulate_s']:.0f}" if "setup_emulate_s" in s else ""
        lines.append(f"| {name} | {s['wall_s']:.0f} | {gate} | {setup} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--to", required=True, help="an MLX commit after the pin")
    r.add_argument("--json", required=True, type=Path)
    rep = sub.add_parser("report")
    rep.add_argument("json", type=Path)
    a = parser.parse_args()
    if a.cmd == "run":
        run(a.to, a.json)
    else:
        print(page(json.loads(a.json.read_text())))


if __name__ == "__main__":
    main()
