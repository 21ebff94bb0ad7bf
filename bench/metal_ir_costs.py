"""What a compiler makes of the Metal PR's tile, read from optimized IR
(``patchkit.verify.emulate.costs`` says what and how): the page and its JSON.

  python3 bench/metal_ir_costs.py run --json metal-ir.json
  python3 bench/metal_ir_costs.py report metal-ir.json

``patchkit emulate --costs`` prints the same without writing the page. A Mac's Metal
compiler and its register report settle it (``patchkit mac-report``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from patchkit.verify.emulate import costs  # noqa: E402


def run(out: Path) -> None:
    report = {"command": "python3 bench/metal_ir_costs.py run " + shlex.join(sys.argv[2:]),
              **costs.collect(ROOT)}  # fmt: skip
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(costs.page(report))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--json", required=True, type=Path)
    rep = sub.add_parser("report")
    rep.add_argument("json", type=Path)
    a = parser.parse_args()
    if a.cmd == "run":
        run(a.json)
    else:
        print(costs.page(json.loads(a.json.read_text())))


if __name__ == "__main__":
    main()
