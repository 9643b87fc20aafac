"""The relay's status page (``/``): server-side HTML from the status record served at ``/status.json``.

Owns: the page's markup (``templates/status.html``, jinja2 with autoescaping ON: every string in
the status record came from the network: peer ids, model names, the tracker's address) and the
pure shaping of a status record into what the template draws (bar offsets, shortened ids, number
formats). The page's inline script re-fetches ``/status.json`` and rebuilds the same markup with
DOM calls (``textContent``/``setAttribute``, never ``innerHTML``); its helpers mirror the ones
here one for one, so a change to either side must be made to both (tests compare the two).

Must not import trio, Starlette or the swarm client: the server builds the record and serves
the string returned here.

The status record (``status``)::

    {"relay": {"peer_id": str, "tracker": str, "version": str},
     "models": [{"alias": str, "name": str, "sha256": str, "n_layer": int, "context_length": int,
                 "covered": bool,
                 "coverage": [{"peer_id": str, "begin": int, "end": int,
                               "state": "READY" | "LOADING" | "FAILED", "alive": bool}]}],
     "prefix_caches": [{"peer_id": str, "model": str, "begin": int, "end": int, "alive": bool,
                        "lookups": int, "hits": int, "hit_tokens": int, "hit_rate": float,
                        "used_bytes": int, "budget_bytes": int}],   # agent.core.relay.coverage
     "live_sessions": int, "recent_tokens_per_s": float,
     "credits": [{"peer_id": str, "rows": int, "credit": float, "completions": int}],
     "updated_at_s": float}   # Unix time (wall clock), seconds
"""

from __future__ import annotations

import datetime
import functools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

__all__ = ["NODE_STATES", "render_status_page", "short_peer_id", "status_view"]

NODE_STATES = ("READY", "LOADING", "FAILED")
# Peer ids share their first characters ("12D3KooW" for every Ed25519 key): the tail tells
# nodes apart.
_SHORT_ID_HEAD = 4
_SHORT_ID_TAIL = 6
# Above this many layers one grid line per layer is a grey blur; the axis ticks remain.
_MAX_GRID_LAYERS = 64

_TEMPLATES_DIR = Path(__file__).with_name("templates")


@functools.cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(_TEMPLATES_DIR),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render_status_page(status: Mapping[str, Any], *, status_url: str = "/status.json", refresh_s: float = 5.0) -> str:
    """The status page for ``status`` (the record above) as a complete HTML document.

    Args:
      status: the status record; its strings are treated as untrusted text.
      status_url: where the page's script re-fetches the record.
      refresh_s: the pause between two re-fetches (> 0).

    Raises:
      KeyError, TypeError, ValueError: ``status`` does not have the shape above.
    """
    if not refresh_s > 0:
        raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
    return (
        _environment()
        .get_template("status.html")
        .render(
            view=status_view(status),
            status_url=status_url,
            refresh_ms=max(1, round(refresh_s * 1000)),
        )
    )


def short_peer_id(peer_id: str) -> str:
    """``12D3…Ab3dEf`` for a long peer id; short ones unchanged."""
    if len(peer_id) <= _SHORT_ID_HEAD + _SHORT_ID_TAIL + 1:
        return peer_id
    return f"{peer_id[:_SHORT_ID_HEAD]}…{peer_id[-_SHORT_ID_TAIL:]}"


def status_view(status: Mapping[str, Any]) -> dict[str, Any]:
    """What the template draws, computed from the status record (mirrored by the page's script)."""
    relay = status["relay"]
    models = [_model_view(model) for model in status["models"]]
    nodes: dict[str, bool] = {}
    for model in status["models"]:
        for node in model["coverage"]:
            nodes[str(node["peer_id"])] = nodes.get(str(node["peer_id"]), False) or bool(node["alive"])
    credits = sorted(status["credits"], key=lambda c: -float(c["credit"]))
    return {
        "relay": {
            "peer_id": str(relay["peer_id"]),
            "peer_id_short": short_peer_id(str(relay["peer_id"])),
            "tracker": str(relay["tracker"]),
            "version": str(relay["version"]),
        },
        "updated": _format_time(float(status["updated_at_s"])),
        "live_sessions": _format_int(status["live_sessions"]),
        "tokens_per_s": _format_fixed(status["recent_tokens_per_s"], 1),
        "models_covered": sum(1 for m in models if m["covered"]),
        "models_total": len(models),
        "nodes_alive": sum(1 for alive in nodes.values() if alive),
        "nodes_total": len(nodes),
        "models": models,
        "prefix_caches": [_prefix_cache_view(cache) for cache in status["prefix_caches"]],
        "credits": [
            {
                "peer_id": str(c["peer_id"]),
                "peer_id_short": short_peer_id(str(c["peer_id"])),
                "rows": _format_int(c["rows"]),
                "completions": _format_int(c["completions"]),
                "credit": _format_fixed(c["credit"], 2),
            }
            for c in credits
        ],
    }


def _model_view(model: Mapping[str, Any]) -> dict[str, Any]:
    n_layer = int(model["n_layer"])
    return {
        "alias": str(model["alias"]),
        "name": str(model["name"]),
        "sha256": str(model["sha256"]),
        "sha256_short": str(model["sha256"])[:12],
        "n_layer": n_layer,
        "context_length": _format_int(model["context_length"]),
        "covered": bool(model["covered"]),
        "grid": 0 < n_layer <= _MAX_GRID_LAYERS,
        "ticks": [{"layer": layer, "left": _percent(layer, n_layer)} for layer in _ticks(n_layer)],
        "coverage": [_node_view(node, n_layer) for node in model["coverage"]],
    }


def _node_view(node: Mapping[str, Any], n_layer: int) -> dict[str, Any]:
    begin, end = int(node["begin"]), int(node["end"])
    state = str(node["state"])
    # A bar never leaves its track, whatever a peer claims; the text keeps the claimed range.
    lo, hi = _clamp(begin, 0, n_layer), _clamp(end, 0, n_layer)
    return {
        "peer_id": str(node["peer_id"]),
        "peer_id_short": short_peer_id(str(node["peer_id"])),
        "range": f"[{begin}, {end})",
        "state": state,
        "state_class": state.lower() if state in NODE_STATES else "unknown",
        "alive": bool(node["alive"]),
        "left": _percent(lo, n_layer),
        "width": _percent(max(hi - lo, 0), n_layer),
    }


def _prefix_cache_view(cache: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "peer_id": str(cache["peer_id"]),
        "peer_id_short": short_peer_id(str(cache["peer_id"])),
        "alive": bool(cache["alive"]),
        "model": str(cache["model"]),
        "range": f"[{int(cache['begin'])}, {int(cache['end'])})",
        "hit_rate": _format_fixed(100 * float(cache["hit_rate"]), 1) + "%",
        "hits": f"{_format_int(cache['hits'])} / {_format_int(cache['lookups'])}",
        "hit_tokens": _format_int(cache["hit_tokens"]),
        "bytes": f"{_format_mib(cache['used_bytes'])} / {_format_mib(cache['budget_bytes'])}",
    }


def _ticks(n_layer: int) -> list[int]:
    if n_layer <= 0:
        return []
    # Quarters, halves rounded up (round() would round them to even, the script's Math.round up).
    return sorted({(2 * n_layer * i + 4) // 8 for i in range(5)})


def _percent(layers: int, n_layer: int) -> str:
    # Integer arithmetic, rounding halves up: floats would round 100 * 1 / 64 = 1.5625 to
    # 1.562 here (half to even) and to 1.563 in the script (toFixed).
    if n_layer <= 0:
        return "0.000%"
    thousandths = (200_000 * layers + n_layer) // (2 * n_layer)
    return f"{thousandths // 1000}.{thousandths % 1000:03d}%"


def _clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(value, hi))


def _format_int(value: Any) -> str:
    return f"{int(value):,}"


def _format_fixed(value: Any, digits: int) -> str:
    # floor(x * 10^d + 0.5) is the same IEEE arithmetic as the script's Math.floor, so both
    # sides print the same digits (format(x, ".2f") and toFixed round halves differently).
    x = float(value)
    if not math.isfinite(x):
        return "—"
    scaled = math.floor(x * 10**digits + 0.5)
    sign, scaled = ("-", -scaled) if scaled < 0 else ("", scaled)
    whole, frac = divmod(scaled, 10**digits)
    return f"{sign}{whole}.{frac:0{digits}d}"


def _format_mib(value: Any) -> str:
    return _format_fixed(float(int(value)) / 1048576, 1) + " MiB"


def _format_time(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
