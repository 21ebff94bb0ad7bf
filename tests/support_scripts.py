"""Load a script of this repository (bench/, ci/) as a module, for its tests.

The scripts run as files (``python ci/x.py``) and are not a package; the tests reach
their functions through this one loader.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str) -> ModuleType:
    """The module of ``ROOT / relative`` (e.g. ``ci/no_differing_rows.py``), run once."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
