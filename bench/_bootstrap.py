"""Makes the project importable from a bench script run as ``python bench/<script>.py``.

Puts the repository root (for ``agent``) and ``bench/`` (for the scripts' shared helpers, e.g.
``common.machine_info``) on ``sys.path``. Every script imports it before anything of the
project; the import itself works because a script's own directory is always on ``sys.path``.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["BENCH_DIR", "REPO_ROOT"]

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
for _p in (str(REPO_ROOT), str(BENCH_DIR)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
