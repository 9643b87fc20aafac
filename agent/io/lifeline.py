"""Nothing Baton starts outlives the process that started it, however that process ends.

Owns a child process's tie to its parent's life, in two forms:

- The *lifeline*, for Baton's own commands started by a Baton process (the harness's tracker,
  nodes and relay): the read end of a pipe whose write end only the parent process holds
  (close-on-exec, never passed on). The parent gives it with ``lifeline_for_child`` (an
  environment entry naming the fd, and the fd for ``pass_fds``); the child, in
  ``agent.cli.main`` before any command runs, calls ``watch_lifeline``, whose daemon thread
  blocks reading it. The kernel closes the write end when the parent process ends, by exit, a
  crash, SIGTERM or SIGKILL, and not before: unlike PR_SET_PDEATHSIG it does not matter which
  of the parent's threads forked the child (trio forks from cached threads that retire). End
  of file means the parent is gone: the child sends itself SIGTERM, so it stops the way
  ``kill`` and systemd stop it (a node stops its workers first), and SIGKILLs itself (its
  process group when it leads one: its workers with it) if it is still there ``grace_s`` later.
- ``die_with_parent``, for programs that are not Baton's and cannot watch a lifeline
  (headless Chromium, llama.cpp's rpc-server and llama-bench): a ``preexec_fn`` that arms
  PR_SET_PDEATHSIG (Linux) and gives up at once if the parent is already gone. That signal
  fires when the *forking thread* exits, so the fork must come from a thread that lives as
  long as the child: the main thread, or one that blocks until the child exits
  (``subprocess.run``); ``die_with_parent`` refuses another thread unless told
  (``waited=True``) that it waits. The signal is SIGKILL: nobody is left to follow a SIGTERM
  that hangs, and Chromium's helper processes stop by themselves once the browser is gone.

The native worker arms its own PR_SET_PDEATHSIG with a parent check that tolerates retiring
threads (native/src/main.cpp); it is not started through this module.

Limits: a parent that ``os.fork()``s without exec hands the write end to the fork; the fork
closes it at once (``os.register_at_fork``), so only a fork made by other means (a C
extension) would keep the children alive. Must not import trio: ``watch_lifeline`` runs before
a command's event loop, and ``die_with_parent``'s function runs in a forked child.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping

__all__ = [
    "LIFELINE_ENV",
    "LifelineConfig",
    "die_with_parent",
    "lifeline_for_child",
    "watch_lifeline",
]

#: Names the inherited fd of a child's lifeline (the read end of its parent's pipe).
LIFELINE_ENV = "BATON_LIFELINE_FD"

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

# The parent's pipe, made on first use: (read end, write end), both close-on-exec.
_pipe: tuple[int, int] | None = None
_pipe_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class LifelineConfig:
    """How a child stops once its parent is gone.

    ``grace_s``: seconds between the SIGTERM the child sends itself and the SIGKILL that
    follows if it is still running; longer than a node's worker stop grace (5 s), so that a
    node can stop its workers itself.
    """

    grace_s: float = 10.0


def _parent_pipe() -> tuple[int, int]:
    global _pipe
    with _pipe_lock:
        if _pipe is None:
            _pipe = os.pipe()  # close-on-exec (PEP 446): no exec'd child ever holds the write end
        return _pipe


def _forget_pipe_in_fork() -> None:
    # A fork without exec would keep the write end open, and with it every child's lifeline.
    # The read end stays: subprocess runs this hook too when given a preexec_fn, and its child
    # may be about to inherit that end as its own lifeline (close-on-exec drops it otherwise).
    global _pipe, _pipe_lock
    _pipe_lock = threading.Lock()  # the parent's may have been held by another thread
    if _pipe is not None:
        _read_fd, write_fd = _pipe
        _pipe = None
        with contextlib.suppress(OSError):
            os.close(write_fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pipe_in_fork)


def lifeline_for_child(environment: Mapping[str, str] | None = None) -> tuple[dict[str, str], tuple[int]]:
    """``(env, pass_fds)`` for starting a Baton command that stops when this process ends.

    ``env`` is ``environment`` (None: this process's) with ``LIFELINE_ENV`` naming the fd;
    pass both to ``subprocess.Popen`` (``env=env, pass_fds=pass_fds``). The child must call
    ``watch_lifeline`` (``agent.cli.main`` does, for every ``baton`` command). Every child of
    this process shares one pipe, made on the first call and held until this process ends.
    """
    read_fd, _write_fd = _parent_pipe()
    env = dict(os.environ if environment is None else environment)
    env[LIFELINE_ENV] = str(read_fd)
    return env, (read_fd,)


def watch_lifeline(environ: MutableMapping[str, str] | None = None, config: LifelineConfig | None = None) -> bool:
    """If this process was given a lifeline (``LIFELINE_ENV`` in ``environ``, default
    ``os.environ``), watch it: once the parent process is gone, send this process SIGTERM,
    then SIGKILL after ``config.grace_s`` (its process group too when it leads one). Returns
    whether a lifeline is watched.

    ``LIFELINE_ENV`` is removed from ``environ`` and the fd made non-inheritable, so that this
    process's own children never take a lifeline that is not theirs. A value that names no
    pipe of this process (an environment copied from elsewhere) is ignored.

    Resource handling: a daemon thread blocks reading the fd for the rest of the process.
    """
    environ = os.environ if environ is None else environ
    config = LifelineConfig() if config is None else config
    text = environ.pop(LIFELINE_ENV, None)
    if text is None:
        return False
    try:
        fd = int(text)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return False
        os.set_inheritable(fd, False)
    except (ValueError, OSError):
        return False
    threading.Thread(target=_watch, args=(fd, config.grace_s), name="baton-lifeline", daemon=True).start()
    return True


def _watch(fd: int, grace_s: float) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return  # the fd is not readable after all: nothing to watch
        if not data:
            break  # end of file: every write end is closed, the parent process is gone
    print(f"baton: parent process gone; stopping (SIGKILL after {grace_s:g} s)", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    # Not synchronisation: the deadline by which a stop that hangs is forced.
    time.sleep(grace_s)
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)  # leading its group (the harness's processes): its workers too
    else:
        # The group is someone else's (a shell job, a test runner): only itself; its native
        # workers stop on their own when it dies (their PR_SET_PDEATHSIG).
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent(then: Callable[[], None] | None = None, *, waited: bool = False) -> Callable[[], None]:
    """A ``preexec_fn`` for a program that is not Baton's: it gets SIGKILL when this process
    ends (Linux: PR_SET_PDEATHSIG), and exits at once (code 1, before exec) if this process
    ended before the signal was armed. ``then``: a further ``preexec_fn`` to run after (for
    instance ``agent.io.cpu_policy.kernel_default``). Elsewhere than Linux: ``then`` alone.

    PR_SET_PDEATHSIG fires when the thread that forked the child exits, so call this in the
    thread that will start the child: the main thread (``subprocess.Popen``), or, with
    ``waited=True``, any thread that then blocks until the child exits (``subprocess.run``).
    Chromium's helper processes (zygotes, renderers) stop by themselves once the browser is
    gone (measured: all gone within 3 s).

    Raises:
      RuntimeError: called outside the main thread without ``waited=True``.
    """
    if not waited and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "die_with_parent outside the main thread: the child would be signalled when this thread "
            "exits; start it from the main thread, or pass waited=True if this thread waits for it"
        )
    if not sys.platform.startswith("linux"):
        return then if then is not None else _nothing
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent_pid = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died between fork and prctl: no signal will come
            os._exit(1)
        if then is not None:
            then()

    return arm


def _nothing() -> None:
    pass
