"""Where a benchmark's report goes: printed as markdown, and written as ``NAME.json`` and
``NAME.md`` under the output folder when one is given (``bench/results`` for committed runs).

Owns nothing else: the reports themselves are each script's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["publish"]


def publish(out: Path | None, name: str, report: dict, text: str) -> None:
    """Print ``text``; with ``out``, write ``report`` (JSON) and ``text`` there as ``name``.json/.md."""
    print(text)
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{name}.md").write_text(text)
    print(f"wrote {out / name}.json and {name}.md", file=sys.stderr)
