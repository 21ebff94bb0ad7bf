"""Device driver: ``python3 -m patchkit.verify.probe``, for hosts without patchkit's CLI deps.

The GPU host has MLX but not tomlkit/GitPython, which ``patchkit.cli`` imports;
this driver needs only the probe package. It writes JSON + markdown after every
(bits, arm), so a run cut off by its deadline still returns what it finished.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from patchkit.verify.probe import report
from patchkit.verify.probe.run import Options, run


def main(argv: list[str] | None = None) -> None:
    """Parse options, run the probe, write ``--out`` (.json and .md)."""
    ap = argparse.ArgumentParser(prog="python3 -m patchkit.verify.probe", description=__doc__)
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--bits", type=int, action="append")
    ap.add_argument("--arm", action="append", choices=["stock", "streamed", "reordered"])
    ap.add_argument("--max-t", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timing", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--attention", choices=["fused", "per_query"], default="fused")
    ap.add_argument("--deadline", type=float, help="seconds; no new (bits, arm) after")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    opts = Options(
        size=a.size,
        bits=tuple(a.bits or (4, 8)),
        arms=tuple(a.arm or ("stock", "streamed")),
        ts=tuple(range(2, a.max_t + 1)),
        prompt_len=a.prompt_len,
        seed=a.seed,
        timing=a.timing,
        repeats=a.repeats,
        alpha=a.acceptance,
        deadline_s=a.deadline,
        attention=a.attention,
    )
    command = "python3 -m patchkit.verify.probe " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    payload = run(opts, lambda m: print(m, flush=True), lambda p: report.write(p, a.out, command))
    report.write(payload, a.out, command)
    print(report.human(payload), flush=True)


if __name__ == "__main__":
    main()
