"""agent.io.relay.status_page: the markup, its escaping, and the live page in headless Chromium.

The Chromium tests serve the page from a stdlib HTTP server in a thread (``/`` and a
``/status.json`` that differs from what ``/`` was rendered from), load it with
``agent.harness.browser`` and check the DOM after the page's script ran.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import functools
import http.server
import json
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import trio

from agent.harness.browser import (
    BrowserError,
    ChromiumNotFound,
    chromium_available,
    dump_dom,
    find_chromium,
    screenshot,
)
from agent.io.relay.status_page import render_status_page, short_peer_id

pytestmark = pytest.mark.worker

needs_chromium = pytest.mark.skipif(
    not chromium_available(),
    reason="headless Chromium not found: install Debian's chromium (make deps) or set BATON_CHROMIUM",
)

BROWSER_TIMEOUT_S = 90.0
HOSTILE = "<script>alert(1)</script>"
NODE_A = "12D3KooWAlphaNodeAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA1"
NODE_B = "12D3KooWBravoNodeBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB2"
NODE_LATE = "12D3KooWLateJoinerNodeLLLLLLLLLLLLLLLLLLLLLLLATE01"

STATUS: dict[str, Any] = {
    "relay": {
        "peer_id": "12D3KooWRelayRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRRR9",
        "tracker": "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWTrackerTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTTT7",
        "version": "0.1.0",
    },
    "models": [
        {
            "alias": "smollm2",
            "name": "SmolLM2-135M-Instruct Q4_1",
            "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "n_layer": 30,
            "context_length": 8192,
            "covered": True,
            "coverage": [
                {"peer_id": NODE_A, "begin": 0, "end": 12, "state": "READY", "alive": True},
                {"peer_id": NODE_B, "begin": 12, "end": 30, "state": "READY", "alive": True},
            ],
        },
        {
            "alias": "gemma3",
            "name": "<img src=x onerror=alert(2)>",
            "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "n_layer": 18,
            "context_length": 32768,
            "covered": False,
            "coverage": [
                {"peer_id": NODE_B, "begin": 0, "end": 9, "state": "LOADING", "alive": True},
                {"peer_id": HOSTILE, "begin": 9, "end": 18, "state": "READY", "alive": False},
            ],
        },
    ],
    "prefix_caches": [
        {
            "peer_id": NODE_A,
            "model": "smollm2",
            "begin": 0,
            "end": 12,
            "alive": True,
            "lookups": 40,
            "hits": 34,
            "hit_tokens": 21760,
            "hit_rate": 0.85,
            "used_bytes": 48 << 20,
            "budget_bytes": 64 << 20,
        },
        {
            "peer_id": HOSTILE,
            "model": "<img src=x onerror=alert(3)>",
            "begin": 9,
            "end": 18,
            "alive": False,
            "lookups": 0,
            "hits": 0,
            "hit_tokens": 0,
            "hit_rate": 0.0,
            "used_bytes": 0,
            "budget_bytes": 1 << 20,
        },
    ],
    "live_sessions": 3,
    "recent_tokens_per_s": 41.25,
    "credits": [
        {"peer_id": NODE_B, "rows": 7890, "credit": 12.25, "completions": 9},
        {"peer_id": NODE_A, "rows": 123456, "credit": 98.5, "completions": 40},
        {"peer_id": HOSTILE, "rows": 10, "credit": 0.0, "completions": 0},
    ],
    "updated_at_s": 1796126400.75,
}


def changed_status() -> dict[str, Any]:
    """What /status.json serves: one more node (gemma3 now covered), one more session."""
    status = copy.deepcopy(STATUS)
    gemma = status["models"][1]
    gemma["coverage"].append({"peer_id": NODE_LATE, "begin": 0, "end": 18, "state": "READY", "alive": True})
    gemma["covered"] = True
    status["live_sessions"] = 4
    status["prefix_caches"][0].update(lookups=41, hits=35, hit_rate=35 / 41)
    status["updated_at_s"] += 5
    return status


# --- a small DOM, parsed with the stdlib, for both the template's output and Chromium's dump ---

_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@dataclasses.dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element | str] = dataclasses.field(default_factory=list)

    def iter(self) -> Iterator[Element]:
        yield self
        for child in self.children:
            if isinstance(child, Element):
                yield from child.iter()

    def find_all(self, tag: str | None = None, cls: str | None = None) -> list[Element]:
        return [
            e
            for e in self.iter()
            if (tag is None or e.tag == tag) and (cls is None or cls in e.attrs.get("class", "").split())
        ]

    def find(self, tag: str | None = None, cls: str | None = None) -> Element:
        found = self.find_all(tag, cls)
        assert len(found) == 1, f"{len(found)} elements <{tag} class={cls}>"
        return found[0]

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def outline(self, depth: int = 0) -> list[str]:
        """One line per element (tag, sorted attributes) and per non-blank text (whitespace
        collapsed), indented by depth: comparable across serializers, readable in a diff."""
        attrs = " ".join(f"{name}={value!r}" for name, value in sorted(self.attrs.items()))
        lines = [f"{'  ' * depth}<{self.tag} {attrs}>"]
        for child in self.children:
            if isinstance(child, Element):
                lines += child.outline(depth + 1)
            elif " ".join(child.split()):
                lines.append(f"{'  ' * (depth + 1)}{' '.join(child.split())!r}")
        return lines


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self._stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {name: value or "" for name, value in attrs})
        self._stack[-1].children.append(element)
        if tag not in _VOID:
            self._stack.append(element)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._stack[-1].children.append(Element(tag, {name: value or "" for name, value in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self._stack) - 1, 0, -1):
            if self._stack[depth].tag == tag:
                del self._stack[depth:]
                return

    def handle_data(self, data: str) -> None:
        self._stack[-1].children.append(data)


def parse(html: str) -> Element:
    builder = _TreeBuilder()
    builder.feed(html)
    builder.close()
    return builder.root


def node_rows(doc: Element) -> list[dict[str, Any]]:
    """Every coverage row: model alias, peer id (title), range text, state text, classes."""
    rows = []
    for model in doc.find_all("article", "model"):
        for row in model.find_all("div", "node"):
            rows.append(
                {
                    "model": model.find("h3").text(),
                    "peer_id": row.find("span", "node-id").attrs["title"],
                    "short": row.find("span", "node-id").text(),
                    "range": row.find("span", "node-range").text(),
                    "state": row.find("span", "node-state").text(),
                    "classes": set(row.attrs["class"].split()),
                    "bar_style": row.find("div", "bar").attrs["style"],
                }
            )
    return rows


def prefix_cache_rows(doc: Element) -> list[tuple[str, list[str]]]:
    """Every prefix cache row: the peer id (title) and the cells' text."""
    body = doc.find("table", "prefix-caches").find("tbody")
    return [
        (tr.find_all("td")[0].attrs["title"], [td.text() for td in tr.find_all("td")]) for tr in body.find_all("tr")
    ]


def credits_table(doc: Element) -> Element:
    (table,) = [t for t in doc.find_all("table") if "prefix-caches" not in t.attrs.get("class", "")]
    return table


def expected_rows(status: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(m["alias"], n["peer_id"], f"[{n['begin']}, {n['end']})") for m in status["models"] for n in m["coverage"]]


# --- markup, no browser ---


def test_page_draws_every_node_and_escapes_network_text() -> None:
    html = render_status_page(STATUS)
    doc = parse(html)

    rows = node_rows(doc)
    assert [(r["model"], r["peer_id"], r["range"]) for r in rows] == expected_rows(STATUS)
    by_key = {(r["model"], r["range"]): r for r in rows}
    # bars are placed by begin/end as a share of n_layer
    assert by_key["smollm2", "[0, 12)"]["bar_style"] == "left: 0.000%; width: 40.000%"
    assert by_key["smollm2", "[12, 30)"]["bar_style"] == "left: 40.000%; width: 60.000%"
    assert by_key["gemma3", "[9, 18)"]["bar_style"] == "left: 50.000%; width: 50.000%"
    assert "state-loading" in by_key["gemma3", "[0, 9)"]["classes"]
    assert "state-ready" in by_key["smollm2", "[0, 12)"]["classes"]
    assert "offline" in by_key["gemma3", "[9, 18)"]["classes"]
    assert by_key["gemma3", "[9, 18)"]["state"] == "READY · offline"
    assert "offline" not in by_key["gemma3", "[0, 9)"]["classes"]
    assert by_key["smollm2", "[0, 12)"]["short"] == "12D3…AAAAA1"

    # hostile text is text, never markup: the only script is the page's own
    assert HOSTILE not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<img" not in html
    assert "&lt;img src=x onerror=alert(2)&gt;" in html
    assert len(doc.find_all("script")) == 1
    assert len(doc.find_all("img")) == 0
    assert doc.find("span", "offline-mark") is not None
    assert by_key["gemma3", "[9, 18)"]["peer_id"] == HOSTILE

    badges = [(m.find("h3").text(), m.find("span", "badge").text()) for m in doc.find_all("article", "model")]
    assert badges == [("smollm2", "covered"), ("gemma3", "not covered")]
    tiles = [t.find("span", "tile-value").text() for t in doc.find_all("div", "tile")]
    assert tiles == ["3", "41.3", "1 / 2", "2 / 3"]
    assert (
        doc.find("dd", "updated").text()
        == "2026-12-01 12:00:00 UTC"
        == datetime.datetime.fromtimestamp(1796126400, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    )

    # each range's prefix cache: hit rate, hits of lookups, tokens copied, bytes used of its budget
    assert prefix_cache_rows(doc) == [
        (NODE_A, ["12D3…AAAAA1", "smollm2", "[0, 12)", "85.0%", "34 / 40", "21,760", "48.0 MiB / 64.0 MiB"]),
        (
            HOSTILE,
            [
                short_peer_id(HOSTILE),
                "<img src=x onerror=alert(3)>",
                "[9, 18)",
                "0.0%",
                "0 / 0",
                "0",
                "0.0 MiB / 1.0 MiB",
            ],
        ),
    ]
    assert "&lt;img src=x onerror=alert(3)&gt;" in html
    assert [tr.attrs.get("class") for tr in doc.find("table", "prefix-caches").find_all("tr")[1:]] == [None, "offline"]

    # credits, highest first
    credits = credits_table(doc)
    credit_rows = [[td.text() for td in tr.find_all("td")] for tr in credits.find("tbody").find_all("tr")]
    assert credit_rows == [
        [short_peer_id(NODE_A), "123,456", "40", "98.50"],
        [short_peer_id(NODE_B), "7,890", "9", "12.25"],
        [short_peer_id(HOSTILE), "10", "0", "0.00"],
    ]
    assert [td.attrs["title"] for td in credits.find("tbody").find_all("td", "mono")] == [NODE_A, NODE_B, HOSTILE]

    main = doc.find("main")
    assert main.attrs["data-status-url"] == "/status.json"
    assert main.attrs["data-refresh-ms"] == "5000"


def test_page_needs_no_external_assets() -> None:
    html = render_status_page(STATUS)
    doc = parse(html)
    assert not doc.find_all("link")
    assert all("src" not in e.attrs for e in doc.iter())
    assert "http://" not in html and "https://" not in html
    assert "url(" not in html


def test_odd_ranges_stay_inside_their_track() -> None:
    status = copy.deepcopy(STATUS)
    status["models"][0]["coverage"] = [
        {"peer_id": "p1", "begin": 20, "end": 45, "state": "READY", "alive": True},
        {"peer_id": "p2", "begin": 25, "end": 5, "state": 'WEIRD"><b>x</b>', "alive": True},
        {"peer_id": "p3", "begin": -5, "end": 3, "state": "FAILED", "alive": True},
    ]
    status["models"][1] = {**status["models"][1], "n_layer": 0, "coverage": []}
    doc = parse(render_status_page(status))
    rows = {r["peer_id"]: r for r in node_rows(doc)}
    assert rows["p1"]["bar_style"] == "left: 66.667%; width: 33.333%"
    assert rows["p1"]["range"] == "[20, 45)"
    assert rows["p2"]["bar_style"] == "left: 83.333%; width: 0.000%"
    assert "state-unknown" in rows["p2"]["classes"]
    assert rows["p2"]["state"] == 'WEIRD"><b>x</b>'
    assert not doc.find_all("b")
    assert rows["p3"]["bar_style"] == "left: 0.000%; width: 10.000%"
    assert "state-failed" in rows["p3"]["classes"]
    gemma = doc.find_all("article", "model")[1]
    assert gemma.find("p", "empty").text() == "No node serves this model."
    assert not gemma.find_all("span", "tick")


def test_empty_status() -> None:
    status = {**STATUS, "models": [], "prefix_caches": [], "credits": []}
    doc = parse(render_status_page(status, refresh_s=2.5, status_url="/relay/status.json"))
    assert [p.text() for p in doc.find_all("p", "empty")] == [
        "No models registered.",
        "No node reports a prefix cache.",
        "No credits yet.",
    ]
    main = doc.find("main")
    assert (main.attrs["data-status-url"], main.attrs["data-refresh-ms"]) == ("/relay/status.json", "2500")
    with pytest.raises(ValueError):
        render_status_page(STATUS, refresh_s=0)


# --- the live page in headless Chromium ---


@pytest.fixture
def status_server() -> Iterator[str]:
    """Base URL of a thread serving ``/`` (rendered from STATUS), ``/same`` (its script re-fetches
    STATUS itself) and the records ``/status.json`` (changed_status()) and ``/same.json`` (STATUS)."""
    refresh_s = 0.5  # many re-fetches within the virtual time budget
    routes = {
        "/": ("text/html; charset=utf-8", render_status_page(STATUS, refresh_s=refresh_s).encode()),
        "/same": (
            "text/html; charset=utf-8",
            render_status_page(STATUS, refresh_s=refresh_s, status_url="/same.json").encode(),
        ),
        "/status.json": ("application/json", json.dumps(changed_status()).encode()),
        "/same.json": ("application/json", json.dumps(STATUS).encode()),
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = routes.get(self.path)
            if route is None:
                self.send_error(404)
                return
            content_type, body = route
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@needs_chromium
async def test_script_keeps_the_page_live(status_server: str, tmp_path: Path) -> None:
    dom = parse(await dump_dom(status_server + "/", timeout_s=BROWSER_TIMEOUT_S, virtual_time_budget_ms=3000))

    main = dom.find("main")
    assert main.attrs["data-rendered"] == "script"
    rows = node_rows(dom)
    assert [(r["model"], r["peer_id"], r["range"]) for r in rows] == expected_rows(changed_status())
    late = [r for r in rows if r["peer_id"] == NODE_LATE]
    assert [(r["model"], r["range"], r["short"]) for r in late] == [("gemma3", "[0, 18)", "12D3…LATE01")]
    assert "LATE01" not in render_status_page(STATUS)
    tiles = [t.find("span", "tile-value").text() for t in dom.find_all("div", "tile")]
    assert tiles == ["4", "41.3", "2 / 2", "3 / 4"]
    assert prefix_cache_rows(dom)[0] == (
        NODE_A,
        ["12D3…AAAAA1", "smollm2", "[0, 12)", "85.4%", "35 / 41", "21,760", "48.0 MiB / 64.0 MiB"],
    )
    assert dom.find("p", "stale").attrs.get("hidden") == ""

    # the hostile peer id went in through textContent/setAttribute: still text, no new script
    assert len(dom.find_all("script")) == 1
    assert not dom.find_all("img")
    assert [r["short"] for r in rows if r["peer_id"] == HOSTILE] == [short_peer_id(HOSTILE)]
    assert short_peer_id(HOSTILE) == "<scr…cript>"

    png = await screenshot(
        status_server + "/", tmp_path / "status.png", width=1100, height=1000, timeout_s=BROWSER_TIMEOUT_S,
        virtual_time_budget_ms=3000,
    )  # fmt: skip
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000


@needs_chromium
async def test_script_renders_the_same_markup_as_the_template(status_server: str) -> None:
    dom = parse(await dump_dom(status_server + "/same", timeout_s=BROWSER_TIMEOUT_S, virtual_time_budget_ms=2000))
    served = parse(render_status_page(STATUS, refresh_s=0.5, status_url="/same.json"))

    live_main, served_main = dom.find("main"), served.find("main")
    assert live_main.attrs["data-rendered"] == "script"
    assert served_main.attrs["data-rendered"] == "server"
    assert live_main.outline()[1:] == served_main.outline()[1:]


# --- the browser harness itself ---


def test_chromium_override_must_be_executable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATON_CHROMIUM", str(tmp_path / "no-such-browser"))
    assert not chromium_available()
    with pytest.raises(ChromiumNotFound, match="BATON_CHROMIUM"):
        find_chromium()


async def test_a_failing_browser_is_an_error_and_leaves_no_temp_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(BrowserError, match="exited with code 1") as caught:
        await dump_dom("http://127.0.0.1:9/", timeout_s=BROWSER_TIMEOUT_S, binary=shutil.which("false"))
    assert caught.value.exit_code == 1
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def spawned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[subprocess.Popen]:
    """Every process the harness starts (it forks with ``subprocess.Popen`` on the event loop's
    thread, so that the browser's parent-death signal is tied to a thread that lives as long
    as the process); temp dirs go under tmp_path/tmp (to check they are gone)."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    processes: list[subprocess.Popen] = []
    popen = subprocess.Popen

    def spy(*args: Any, **kwargs: Any) -> subprocess.Popen:
        process = popen(*args, **kwargs)
        processes.append(process)
        return process

    monkeypatch.setattr(subprocess, "Popen", spy)
    return processes


@needs_chromium
async def test_cancelled_run_reaps_the_browser_and_removes_its_dir(
    spawned: list[subprocess.Popen], tmp_path: Path
) -> None:
    # A server that accepts and never answers: the page never finishes loading.
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    async with listener:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    functools.partial(dump_dom, f"http://127.0.0.1:{port}/", timeout_s=BROWSER_TIMEOUT_S)
                )
                connection = await listener.accept()  # the browser is up and waiting on us
                scope.cancel()
        await connection.aclose()
    assert scope.cancelled_caught
    assert [p.returncode for p in spawned] == [-signal.SIGKILL]
    assert list((tmp_path / "tmp").iterdir()) == []


@needs_chromium
async def test_browser_past_its_timeout_is_an_error(spawned: list[subprocess.Popen], tmp_path: Path) -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    async with listener:
        with pytest.raises(BrowserError, match=r"did not finish within 2.0 s") as caught:
            await dump_dom(f"http://127.0.0.1:{port}/", timeout_s=2.0)
    assert caught.value.exit_code is None
    assert [p.returncode for p in spawned] == [-signal.SIGKILL]
    assert list((tmp_path / "tmp").iterdir()) == []
