"""Headless Chromium as a subprocess, for tests of pages the relay serves (DOM dumps, screenshots).

Owns: finding the browser (``BATON_CHROMIUM``, else Debian's ``/usr/bin/chromium``, else
``chromium`` on PATH), the command line this machine needs (root, no GPU, no display, no network
beyond the page), and each run's lifetime: a fresh temp dir holds the profile, HOME and XDG dirs
(Chromium otherwise writes crash-report and dconf dirs under ``~``) and the captured output; the
browser runs in a session of its own so that it and every helper process it forks are killed
together, and is SIGKILLed by the kernel if the process that started it ends first
(``agent.io.lifeline.die_with_parent``; its helpers then stop by themselves).

Not for production code paths: only tests and benchmarks import this.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import trio

from agent.io.lifeline import die_with_parent
from agent.io.log_tail import log_tail as read_log_tail

__all__ = [
    "CHROMIUM_ENV",
    "BrowserError",
    "ChromiumNotFound",
    "chromium_argv",
    "chromium_available",
    "dump_dom",
    "find_chromium",
    "screenshot",
]

CHROMIUM_ENV = "BATON_CHROMIUM"
DEBIAN_CHROMIUM = "/usr/bin/chromium"

# --headless: the new headless mode (Chromium >= 112), which still has --dump-dom/--screenshot.
# --no-sandbox: the sandbox refuses to run as root (containers, CI).
# --disable-quic, --disable-background-networking, --disable-component-update, --disable-sync,
# --no-first-run: nothing but the page itself goes on the network, and no first-run UI.
_BASE_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-crash-reporter",
    "--disable-breakpad",
    "--hide-scrollbars",
    "--mute-audio",
)


class ChromiumNotFound(RuntimeError):
    """No Chromium binary: set BATON_CHROMIUM or install Debian's chromium (``make deps``)."""


class BrowserError(RuntimeError):
    """Chromium failed, or did not finish within its timeout; the message carries its log tail."""

    def __init__(self, message: str, *, exit_code: int | None, log_tail: str) -> None:
        super().__init__(f"{message}\n--- chromium log tail ---\n{log_tail}" if log_tail else message)
        self.exit_code = exit_code
        self.log_tail = log_tail


def find_chromium() -> Path:
    """The Chromium binary to run.

    Raises:
      ChromiumNotFound: ``BATON_CHROMIUM`` is set but not an executable file, or it is unset
        and neither ``/usr/bin/chromium`` nor ``chromium`` on PATH exists.
    """
    override = os.environ.get(CHROMIUM_ENV)
    if override:
        if os.path.isfile(override) and os.access(override, os.X_OK):
            return Path(override)
        raise ChromiumNotFound(f"{CHROMIUM_ENV}={override!r} is not an executable file")
    for candidate in (DEBIAN_CHROMIUM, shutil.which("chromium")):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise ChromiumNotFound(f"no Chromium: set {CHROMIUM_ENV} or install Debian's chromium (make deps installs it)")


def chromium_available() -> bool:
    try:
        find_chromium()
    except ChromiumNotFound:
        return False
    return True


def chromium_argv(
    binary: str | os.PathLike, user_data_dir: str | os.PathLike, virtual_time_budget_ms: int
) -> list[str]:
    """The command line shared by every run, before the run's own flags and the URL.

    ``--virtual-time-budget`` lets the page's timers and fetches run (virtual time advances
    while nothing is loading) for that long before the DOM is dumped or the screenshot taken,
    without waiting that long in real time.
    """
    return [
        os.fspath(binary),
        *_BASE_FLAGS,
        f"--user-data-dir={os.fspath(user_data_dir)}",
        f"--virtual-time-budget={virtual_time_budget_ms}",
    ]


async def dump_dom(
    url: str, *, timeout_s: float, virtual_time_budget_ms: int = 5000, binary: str | os.PathLike | None = None
) -> str:
    """Load ``url`` and return the DOM as serialized HTML once the virtual time budget is spent.

    Args:
      url: the page (http://, file://).
      timeout_s: real time the whole run may take, browser start included.
      virtual_time_budget_ms: how much (virtual) time the page's scripts get.
      binary: the browser; default ``find_chromium()``.

    Raises:
      ChromiumNotFound: no browser.
      BrowserError: Chromium exited with an error, or ran past ``timeout_s``.

    Resource handling and Cancellation: as ``screenshot``.
    """
    stdout = await _run_chromium(
        url, ["--dump-dom"], timeout_s=timeout_s, virtual_time_budget_ms=virtual_time_budget_ms, binary=binary
    )
    return stdout.decode("utf-8", "replace")


async def screenshot(
    url: str,
    path: str | os.PathLike,
    *,
    width: int,
    height: int,
    timeout_s: float,
    virtual_time_budget_ms: int = 5000,
    binary: str | os.PathLike | None = None,
) -> Path:
    """Load ``url`` in a ``width`` x ``height`` window and write a PNG of the viewport to ``path``.

    Args:
      url, timeout_s, virtual_time_budget_ms, binary: as ``dump_dom``.
      path: the PNG to write (replaced if it exists).
      width, height: the viewport in CSS pixels.

    Returns:
      ``path``, as a Path.

    Raises:
      ChromiumNotFound: no browser.
      BrowserError: Chromium exited with an error, ran past ``timeout_s``, or wrote no file.
      RuntimeError: trio runs outside the main thread (the browser is forked on the calling
        thread, which must outlive it: ``agent.io.lifeline.die_with_parent``).

    Resource handling:
      Each run gets a fresh temp dir (profile, HOME, output); it is removed on every exit.
      The browser and all its helper processes are killed (their session) and the browser
      reaped before returning or raising.

    Cancellation:
      Safe to cancel at any point; the kill, the reap and the removal run shielded and take
      only as long as a SIGKILLed process needs to exit.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"window size must be positive, got {width}x{height}")
    path = Path(path)
    target = path.resolve()
    target.unlink(missing_ok=True)
    await _run_chromium(
        url,
        [f"--screenshot={target}", f"--window-size={width},{height}"],
        timeout_s=timeout_s,
        virtual_time_budget_ms=virtual_time_budget_ms,
        binary=binary,
    )
    if not target.is_file() or target.stat().st_size == 0:
        raise BrowserError(f"chromium wrote no screenshot to {target}", exit_code=0, log_tail="")
    return path


async def _run_chromium(
    url: str,
    run_flags: list[str],
    *,
    timeout_s: float,
    virtual_time_budget_ms: int,
    binary: str | os.PathLike | None,
) -> bytes:
    """Run Chromium once on ``url``; its stdout. See ``screenshot`` for resources and cancellation."""
    if virtual_time_budget_ms < 0:
        raise ValueError(f"virtual_time_budget_ms must be >= 0, got {virtual_time_budget_ms}")
    binary = Path(binary) if binary is not None else find_chromium()
    workdir = Path(tempfile.mkdtemp(prefix="baton-chromium-"))
    try:
        home = workdir / "home"
        home.mkdir()
        env = {
            **os.environ,
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_CACHE_HOME": str(home / ".cache"),
        }
        argv = [*chromium_argv(binary, workdir / "profile", virtual_time_budget_ms), *run_flags, url]
        # Files, not pipes: a helper process that outlives the browser would hold a pipe open.
        out_path, log_path = workdir / "stdout", workdir / "chromium.log"
        with open(out_path, "wb") as out, open(log_path, "wb") as log:
            # Forked here, on the event loop's thread, not through trio's thread cache: the
            # parent-death signal fires when the forking thread exits (agent.io.lifeline).
            process = subprocess.Popen(  # noqa: ASYNC220 (forked on this thread: see above)
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=log, env=env, start_new_session=True,
                preexec_fn=die_with_parent(),
            )  # fmt: skip
        try:
            with trio.move_on_after(timeout_s) as scope:
                await _wait(process)
        finally:
            with trio.CancelScope(shield=True):
                _kill_session(process)
                await _wait(process)
        if scope.cancelled_caught:
            raise BrowserError(
                f"chromium did not finish within {timeout_s} s", exit_code=None, log_tail=read_log_tail(log_path)
            )
        if process.returncode != 0:
            raise BrowserError(
                f"chromium exited with code {process.returncode}",
                exit_code=process.returncode,
                log_tail=read_log_tail(log_path),
            )
        return out_path.read_bytes()
    finally:
        try:
            shutil.rmtree(workdir)
        except OSError:
            # A killed helper may have been mid-way through creating a file: one more pass.
            shutil.rmtree(workdir, ignore_errors=True)


async def _wait(process: subprocess.Popen) -> int:
    """Reap ``process`` once it exits, without holding a thread (Linux: its pidfd, as trio's
    own processes are waited for); cancellable."""
    if process.returncode is not None:
        return process.returncode
    if not hasattr(os, "pidfd_open"):
        return await trio.to_thread.run_sync(process.wait, abandon_on_cancel=True)  # type: ignore[call-arg]  # trio-typing's stale trio stubs
    pidfd = os.pidfd_open(process.pid)
    try:
        await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)
    return process.wait()


def _kill_session(process: subprocess.Popen) -> None:
    # The browser leads its own session and process group (start_new_session); its zygote,
    # renderer and utility processes are in that group and outlive it when it is killed (after
    # a clean exit they have exited too). Before the leader is reaped its pid cannot be reused;
    # after, Linux keeps it reserved while any member of the group is left, so a straggler is
    # still reached, and with none left the call finds nothing to signal.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
