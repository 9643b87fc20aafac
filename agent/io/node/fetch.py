"""Fetching a layer range of a GGUF by HTTP range requests into a sparse local file.

Owns the I/O of model distribution on a node: the local file (``<models dir>/<sha256>.gguf``,
sparse, the GGUF's full size, so the worker maps it as usual), its JSON sidecar
(``<file>.fetch.json``: what it holds, ``agent.core.node.range_fetch.FetchState``), the HTTP
requests (httpx on trio), hashing pieces, and progress (a tqdm bar on a terminal, log lines
otherwise, and a callback the node turns into heartbeat fields). Every decision is the pure
core's (``agent.core.node.range_fetch``): which pieces, which requests, keep / refetch / refuse.

Checks: every piece (the metadata prefix and each tensor) is hashed before ``fetch_range``
returns, also pieces fetched by an earlier run (the local file may have been damaged since);
a piece that hashes wrong is fetched again, then refused (``FetchRefused`` names the tensor and
the source). A source that ignores ``Range`` (answers 200 with the whole file) or answers
another range is refused at once: a node never downloads the whole file by accident.

Resume: the sidecar is written after every ``state_save_bytes`` and when the call ends for any
reason (cancellation included), so an interrupted fetch continues where it stopped; bytes the
sidecar counts but the disk lost show up as a bad hash and are fetched again.

Blocking work: hashing runs in a thread; writes are ``os.pwrite`` of one received chunk into
the page cache, done on the trio thread (microseconds each).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from agent._proto import swarm_pb2
from agent.core.node.range_fetch import (
    FetchRefused,
    FetchState,
    Piece,
    Verdict,
    fetched_bytes,
    plan_requests,
    range_pieces,
    tensor_verdict,
    union_pieces,
)

__all__ = [
    "FetchConfig",
    "FetchError",
    "FetchProgress",
    "FetchRefused",
    "ModelMismatch",
    "fetch_range",
    "model_file_path",
    "verify_local_range",
]

log = logging.getLogger(__name__)

_HASH_CHUNK_BYTES = 1 << 20


class FetchError(Exception):
    """The source could not deliver (unreachable, HTTP error, no range support) after retries."""


@dataclasses.dataclass(frozen=True)
class FetchConfig:
    """Limits of one fetch.

    ``max_request_bytes``: the largest range one request asks for; ``max_attempts``: hash
    failures before a piece is refused; ``max_network_retries``: failed requests in a row
    before giving up (each retry resumes where the last stopped); ``retry_delay_s``: pause
    before a retry; ``timeout_s``: per network operation (connect, each read);
    ``state_save_bytes``: how often the sidecar is written; ``show_progress``: a tqdm bar
    (None: when stderr is a terminal); ``log_interval_s``: progress log lines otherwise.
    """

    max_request_bytes: int = 64 * 1024 * 1024
    max_attempts: int = 2
    max_network_retries: int = 5
    retry_delay_s: float = 1.0
    timeout_s: float = 30.0
    state_save_bytes: int = 8 * 1024 * 1024
    show_progress: bool | None = None
    log_interval_s: float = 5.0


@dataclasses.dataclass(frozen=True)
class FetchProgress:
    """``done_bytes`` of ``total_bytes`` held and verified-or-written; ``bytes_per_s`` this run."""

    done_bytes: int
    total_bytes: int
    bytes_per_s: float


def model_file_path(models_dir: str | os.PathLike[str], model_sha256: str) -> Path:
    return Path(models_dir) / f"{model_sha256}.gguf"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".fetch.json")


def _manifest_id(manifest: swarm_pb2.ModelManifest) -> str:
    return hashlib.sha256(manifest.SerializeToString(deterministic=True)).hexdigest()


def _load_state(path: Path, manifest: swarm_pb2.ModelManifest) -> FetchState:
    manifest_id = _manifest_id(manifest)
    try:
        data = json.loads(_sidecar(path).read_text())
    except (OSError, ValueError):
        data = None
    state = FetchState.from_json(data, manifest_id)
    if not state.written and not state.verified:
        # nothing trusted: (re)start with an empty sparse file of the right size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, 0)
            os.ftruncate(fd, manifest.size_bytes)
        finally:
            os.close(fd)
    elif path.stat().st_size != manifest.size_bytes:
        os.truncate(path, manifest.size_bytes)
    return state


def _save_state(path: Path, state: FetchState) -> None:
    sidecar = _sidecar(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{sidecar.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(state.to_json(), f)
        os.replace(tmp, sidecar)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def verify_local_range(path: str | os.PathLike[str], manifest: swarm_pb2.ModelManifest, begin: int, end: int) -> None:
    """Check that the file at ``path`` holds, byte for byte, what the manifest says blocks
    ``[begin, end)`` read (its metadata and each of those tensors), whatever its size and mtime
    claim. Synchronous: run it in a thread.

    Raises:
      ModelMismatch: the file's size differs, or a piece hashes wrong (named).
      OSError: the file cannot be read.
    """
    path = Path(path)
    size = path.stat().st_size
    if size != manifest.size_bytes:
        raise ModelMismatch(
            f"{path} holds {size} bytes; the model {manifest.model_sha256[:12]} has {manifest.size_bytes}"
        )
    fd = os.open(path, os.O_RDONLY)
    try:
        for piece in range_pieces(manifest, begin, end):
            digest = _hash_piece(fd, piece)
            if digest != piece.sha256:
                raise ModelMismatch(
                    f"tensor {piece.name} of {path} does not match the tracker's manifest of model "
                    f"{manifest.model_sha256[:12]} (sha256 {digest}, expected {piece.sha256}): the file is damaged "
                    "or another file; fetch the model again"
                )
    finally:
        os.close(fd)


class ModelMismatch(Exception):
    """A local model file does not hold the registered model's bytes; the message names what."""


def _hash_piece(fd: int, piece: Piece) -> str:
    digest = hashlib.sha256()
    offset, left = piece.offset, piece.size
    while left > 0:
        chunk = os.pread(fd, min(left, _HASH_CHUNK_BYTES), offset)
        if not chunk:
            break
        digest.update(chunk)
        offset += len(chunk)
        left -= len(chunk)
    return digest.hexdigest()


class _Progress:
    def __init__(self, total: int, done: int, config: FetchConfig, label: str, callback) -> None:
        show = config.show_progress if config.show_progress is not None else sys.stderr.isatty()
        self._bar = None
        if show:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=done, unit="B", unit_scale=True, unit_divisor=1024, desc=label, file=sys.stderr
            )
        self.total, self.done, self.start_done = total, done, done
        self._started = trio.current_time()
        self._logged = self._started
        self._config, self._label, self._callback = config, label, callback

    def set(self, done: int) -> None:
        if self._bar is not None:
            self._bar.update(done - self.done)
        self.done = done
        now = trio.current_time()
        rate = (done - self.start_done) / max(now - self._started, 1e-9)
        if self._bar is None and now - self._logged >= self._config.log_interval_s:
            self._logged = now
            eta = (self.total - done) / rate if rate > 0 else float("inf")
            log.info("%s: %d of %d bytes, %.1f MB/s, ETA %.0f s", self._label, done, self.total, rate / 1e6, eta)
        if self._callback is not None:
            self._callback(FetchProgress(done, self.total, rate))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def fetch_range(
    manifest: swarm_pb2.ModelManifest,
    ranges: Sequence[tuple[int, int]],
    source_url: str,
    dest: str | os.PathLike[str],
    *,
    config: FetchConfig | None = None,
    on_progress: Callable[[FetchProgress], None] | None = None,
    http_client=None,
) -> Path:
    """Make ``dest`` hold (verified) every byte the layer ``ranges`` of ``manifest``'s file need.

    Args:
      manifest: the model's manifest, already checked against the tracker's signature
        (``agent.core.wire.manifest.verify_manifest``).
      ranges: ``(begin, end)`` layer ranges this node serves of the model.
      source_url: an HTTP(S) URL of the whole GGUF that honours ``Range``.
      dest: the local file (created sparse; its sidecar next to it).
      config: limits (``FetchConfig``); on_progress: called after every chunk.

    Returns ``dest`` once every needed piece hashed right.

    Raises:
      FetchRefused: a piece hashed wrong on every attempt (names the tensor and the source).
      FetchError: the source failed ``max_network_retries`` times in a row, or ignores ranges.
      OSError: the local file cannot be written.

    Resource handling: the HTTP client (when made here) and the file are closed on exit; the
    sidecar is saved on every exit. Cancellation: safe at any point (resumes next time).
    """
    import httpx

    config = config or FetchConfig()
    path = Path(dest)
    path.parent.mkdir(parents=True, exist_ok=True)
    pieces = union_pieces(range_pieces(manifest, begin, end) for begin, end in ranges)
    state = await trio.to_thread.run_sync(_load_state, path, manifest)
    label = f"{manifest.model_sha256[:12]} {','.join(f'[{b},{e})' for b, e in ranges)}"
    async with contextlib.AsyncExitStack() as stack:
        fd = os.open(path, os.O_RDWR)
        stack.callback(os.close, fd)
        stack.callback(_save_state, path, state)  # on every exit: the next run resumes
        if http_client is None:
            http_client = await stack.enter_async_context(
                httpx.AsyncClient(timeout=config.timeout_s, follow_redirects=True)
            )
        run = _Run(manifest, pieces, source_url, path, fd, state, config, http_client)
        # what an earlier run left is checked again before anything is reported READY
        for piece in pieces:
            if piece.name in state.verified:
                state.verified.discard(piece.name)
                await run.check(piece)
        run.progress = _Progress(sum(p.size for p in pieces), fetched_bytes(pieces, state), config, label, on_progress)
        stack.callback(run.progress.close)
        failures = 0
        while True:
            for piece in pieces:  # complete but unchecked (zero-size pieces get no request)
                if piece.name not in state.verified and state.have(piece) == piece.size:
                    await run.check(piece)  # a bad one is planned again (or refused)
            requests = plan_requests(pieces, state, config.max_request_bytes)
            if not requests:
                break
            try:
                for request in requests:
                    await run.get(request)
                    failures = 0
            except (httpx.TransportError, _ShortBody) as error:
                failures += 1
                _save_state(path, state)
                if failures > config.max_network_retries:
                    raise FetchError(f"{source_url}: {error} ({failures} failed requests in a row)") from None
                log.warning("fetching from %s: %s; resuming in %.1f s", source_url, error, config.retry_delay_s)
                await trio.sleep(config.retry_delay_s)
        run.progress.set(fetched_bytes(pieces, state))
    return path


class _ShortBody(Exception):
    """A response ended before the bytes it announced (resumed like a transport error)."""


class _Run:
    """One ``fetch_range`` call's moving parts (no decisions: see the core)."""

    def __init__(self, manifest, pieces, source_url, path, fd, state, config, client) -> None:
        self.size_bytes = manifest.size_bytes
        self.pieces = pieces
        self.by_name = {p.name: p for p in pieces}
        self.source_url = source_url
        self.path = path
        self.fd = fd
        self.state = state
        self.config = config
        self.client = client
        self.progress: _Progress | None = None

    async def check(self, piece: Piece) -> None:
        """Hash a complete piece; the core says keep, fetch again, or refuse."""
        digest = await trio.to_thread.run_sync(_hash_piece, self.fd, piece)
        verdict = tensor_verdict(piece, digest, self.state, self.config.max_attempts)
        if verdict is Verdict.REFUSE:
            raise FetchRefused(piece.name, self.source_url, piece.sha256, digest, self.config.max_attempts)
        if verdict is Verdict.REFETCH:
            log.warning("tensor %s from %s hashed wrong (%s): fetching it again", piece.name, self.source_url, digest)

    async def get(self, request) -> None:
        import httpx

        url = self.source_url
        headers = {"Range": request.header, "Accept-Encoding": "identity"}
        async with self.client.stream("GET", url, headers=headers) as response:
            if response.status_code == 200:
                raise FetchError(f"{url} ignores HTTP range requests (answered 200 with the whole file): refused")
            if response.status_code != 206:
                if response.status_code >= 500:
                    raise httpx.TransportError(f"{url} answered HTTP {response.status_code}")
                raise FetchError(f"{url} answered HTTP {response.status_code} to Range: {request.header}")
            expected = f"bytes {request.start}-{request.end - 1}/{self.size_bytes}"
            got = response.headers.get("content-range", "").strip()
            if got != expected:
                raise FetchError(f"{url} answered Content-Range {got!r} to a request for {expected!r}: refused")
            offset = request.start
            names = list(request.pieces)
            unsaved = 0
            async with contextlib.aclosing(response.aiter_raw()) as body:
                async for chunk in body:
                    chunk = chunk[: request.end - offset]
                    if not chunk:
                        break
                    os.pwrite(self.fd, chunk, offset)
                    pos, offset = offset, offset + len(chunk)
                    unsaved += len(chunk)
                    while names and pos < offset:  # credit the bytes to the pieces they belong to
                        piece = self.by_name[names[0]]
                        pos = max(pos, piece.offset)
                        if pos >= offset:
                            break
                        upto = min(offset, piece.end)
                        self.state.written[piece.name] = upto - piece.offset
                        pos = upto
                        if upto == piece.end:
                            names.pop(0)  # hashed by the caller once the response is read
                    assert self.progress is not None
                    self.progress.set(fetched_bytes(self.pieces, self.state))
                    if unsaved >= self.config.state_save_bytes:
                        unsaved = 0
                        _save_state(self.path, self.state)
            if offset < request.end:
                raise _ShortBody(f"the response ended at byte {offset} of {request.header}")
        _save_state(self.path, self.state)
