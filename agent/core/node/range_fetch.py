"""Which bytes of a GGUF a layer range needs, and what to fetch, resume, keep or refuse.

Owns the decisions of model distribution (docs/ARCHITECTURE.md, "Model distribution"); the node's
shell (``agent.io.node.fetch``) only moves bytes and hashes them.

- ``range_pieces``: the pieces a worker serving blocks ``[begin, end)`` reads, exactly as the
  loader patch (patches/0002-*) decides ownership: the metadata prefix always; ``blk.N.*``
  for ``begin <= N < end``; input tensors (``token_embd``, ``position_embd``,
  ``token_types``) only with block 0; output tensors (``output``, ``output_norm``) only with
  the last block, and ``token_embd`` also with the last block when the file has no
  ``output.weight`` (tied embeddings are loaded as the head). Any other tensor outside the
  blocks (``rope_freqs``, per-layer repeating tensors without a block number in their name)
  is read by every range, so every range fetches it.
- ``FetchState``: what a partly fetched file holds, per piece: bytes written (a prefix of the
  piece) and whether its sha256 was checked; kept in a JSON sidecar by the shell. A state for
  another manifest is discarded (the file is fetched again from nothing).
- ``plan_requests``: the HTTP range requests for what is missing: each unverified piece from
  where it stopped, adjacent pieces merged, at most ``max_request_bytes`` each. Bytes between
  pieces (alignment padding) are never requested.
- ``tensor_verdict``: after a piece is complete, KEEP (hash matches), REFETCH (it does not,
  and attempts remain: the piece starts again from its first byte) or REFUSE (the last
  attempt failed too: the error names the piece and the source).

Pure: no I/O, clock or randomness; must not import trio, httpx or agent.io.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable, Sequence
from typing import Any

from agent._proto import swarm_pb2

__all__ = [
    "FETCH_STATE_SCHEMA_VERSION",
    "INPUT_TENSORS",
    "METADATA_PIECE",
    "OUTPUT_TENSORS",
    "FetchRefused",
    "FetchState",
    "Piece",
    "Request",
    "Verdict",
    "fetched_bytes",
    "missing_bytes",
    "plan_requests",
    "range_pieces",
    "tensor_verdict",
]

FETCH_STATE_SCHEMA_VERSION = 1
#: The name of the metadata prefix among the pieces (no GGUF tensor has a name with '<').
METADATA_PIECE = "<metadata>"
#: Non-block tensors the loader counts as the input layer (llama-arch.cpp LLM_TENSOR_LAYER_INPUT).
INPUT_TENSORS = frozenset({"token_embd", "position_embd", "token_types"})
#: Non-block tensors of the output layer (LLM_TENSOR_LAYER_OUTPUT) in the ranged architectures.
OUTPUT_TENSORS = frozenset({"output", "output_norm"})
_BLOCK = re.compile(r"blk\.(\d+)\.")


class FetchRefused(Exception):
    """A piece failed its hash on every attempt; ``piece`` and ``source`` name it."""

    def __init__(self, piece: str, source: str, expected: str, got: str, attempts: int) -> None:
        super().__init__(
            f"tensor {piece} from {source} does not match the tracker's manifest after {attempts} attempts "
            f"(sha256 {got}, expected {expected}): refused"
        )
        self.piece = piece
        self.source = source


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + size)`` of the file that must hash to ``sha256``."""

    name: str
    offset: int
    size: int
    sha256: str

    @property
    def end(self) -> int:
        return self.offset + self.size


def _owned(name: str, begin: int, end: int, n_layer: int, tied: bool) -> bool:
    match = _BLOCK.match(name)
    if match:
        return begin <= int(match.group(1)) < end
    base = name.split(".", 1)[0]
    if base == "token_embd" and tied and end == n_layer:
        return True
    if base in INPUT_TENSORS:
        return begin == 0
    if base in OUTPUT_TENSORS:
        return end == n_layer
    return True


def range_pieces(manifest: swarm_pb2.ModelManifest, begin: int, end: int) -> list[Piece]:
    """The metadata prefix and the tensors a worker for blocks ``[begin, end)`` reads, in file
    order (see the module doc for the rules).

    Raises:
      ValueError: the range is not inside ``[0, n_layer)``.
    """
    n_layer = manifest.n_layer
    if not 0 <= begin < end <= n_layer:
        raise ValueError(f"range [{begin}, {end}) is not inside the model's {n_layer} blocks")
    tied = not any(t.name == "output.weight" for t in manifest.tensors)
    pieces = [Piece(METADATA_PIECE, 0, manifest.metadata_size, manifest.metadata_sha256)]
    pieces += [
        Piece(t.name, t.offset, t.size, t.sha256) for t in manifest.tensors if _owned(t.name, begin, end, n_layer, tied)
    ]
    return pieces


def union_pieces(groups: Iterable[Sequence[Piece]]) -> list[Piece]:
    """The pieces of several ranges of one file, each once, in file order."""
    seen: dict[str, Piece] = {}
    for group in groups:
        for piece in group:
            seen.setdefault(piece.name, piece)
    return sorted(seen.values(), key=lambda p: p.offset)


@dataclasses.dataclass
class FetchState:
    """What the local (sparse) file holds of the file ``manifest_sha256`` names.

    ``written[name]``: bytes of that piece written so far, from its first byte;
    ``verified``: pieces whose bytes hashed right; ``attempts[name]``: hash failures so far.
    """

    manifest_sha256: str
    written: dict[str, int] = dataclasses.field(default_factory=dict)
    verified: set[str] = dataclasses.field(default_factory=set)
    attempts: dict[str, int] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": FETCH_STATE_SCHEMA_VERSION,
            "manifest_sha256": self.manifest_sha256,
            "written": dict(sorted(self.written.items())),
            "verified": sorted(self.verified),
        }

    @classmethod
    def from_json(cls, data: object, manifest_sha256: str) -> FetchState:
        """The state in ``data`` when it is one for ``manifest_sha256``, else an empty one
        (unreadable, another schema or another file: everything is fetched again)."""
        fresh = cls(manifest_sha256)
        if not isinstance(data, dict) or data.get("schema_version") != FETCH_STATE_SCHEMA_VERSION:
            return fresh
        if data.get("manifest_sha256") != manifest_sha256:
            return fresh
        written, verified = data.get("written"), data.get("verified")
        if not isinstance(written, dict) or not isinstance(verified, list):
            return fresh
        state = cls(manifest_sha256)
        for name, n in written.items():
            if isinstance(name, str) and isinstance(n, int) and n >= 0:
                state.written[name] = n
        state.verified = {name for name in verified if isinstance(name, str)}
        return state

    def restart(self, piece: Piece) -> None:
        """Forget what is held of ``piece`` (fetch it again from its first byte)."""
        self.written.pop(piece.name, None)
        self.verified.discard(piece.name)

    def have(self, piece: Piece) -> int:
        """Bytes of ``piece`` held (a written count beyond its size counts as nothing: a
        state from a damaged sidecar)."""
        n = self.written.get(piece.name, 0)
        return n if n <= piece.size else 0


@dataclasses.dataclass(frozen=True)
class Request:
    """One HTTP range request: bytes ``[start, end)`` of the file, covering ``pieces`` (the
    first possibly from the middle, where an interrupted fetch stopped)."""

    start: int
    end: int
    pieces: tuple[str, ...]

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def header(self) -> str:
        return f"bytes={self.start}-{self.end - 1}"


def plan_requests(pieces: Sequence[Piece], state: FetchState, max_request_bytes: int) -> list[Request]:
    """The requests that fetch every unverified piece of ``pieces`` from where it stopped.

    Raises:
      ValueError: ``max_request_bytes`` is not positive.
    """
    if max_request_bytes <= 0:
        raise ValueError(f"max_request_bytes must be > 0, got {max_request_bytes}")
    requests: list[Request] = []
    start = end = -1
    names: list[str] = []

    def flush() -> None:
        if names:
            requests.append(Request(start, end, tuple(names)))

    for piece in sorted(pieces, key=lambda p: p.offset):
        if piece.name in state.verified:
            continue
        have = state.have(piece)
        if have == piece.size:
            # written in full (or empty) but not yet hashed: the shell hashes it, nothing to request
            continue
        piece_start = piece.offset + have
        if names and piece_start == end and (piece.end - start) <= max_request_bytes:
            end = piece.end
            names.append(piece.name)
            continue
        flush()
        # a piece larger than a request is cut into several requests
        start = piece_start
        while piece.end - start > max_request_bytes:
            requests.append(Request(start, start + max_request_bytes, (piece.name,)))
            start += max_request_bytes
        end = piece.end
        names = [piece.name]
    flush()
    return requests


def fetched_bytes(pieces: Sequence[Piece], state: FetchState) -> int:
    """Bytes of ``pieces`` the local file holds (verified in full, or written so far)."""
    return sum(p.size if p.name in state.verified else state.have(p) for p in pieces)


def missing_bytes(pieces: Sequence[Piece], state: FetchState) -> int:
    return sum(p.size for p in pieces) - fetched_bytes(pieces, state)


class Verdict(enum.Enum):
    KEEP = "keep"
    REFETCH = "refetch"
    REFUSE = "refuse"


def tensor_verdict(piece: Piece, digest: str, state: FetchState, max_attempts: int) -> Verdict:
    """Record the hash of a complete piece in ``state`` and say what to do with it: KEEP,
    REFETCH (bad, attempts remain: its bytes are forgotten) or REFUSE (bad on the
    ``max_attempts``-th try)."""
    if digest == piece.sha256:
        state.verified.add(piece.name)
        state.written[piece.name] = piece.size
        return Verdict.KEEP
    state.attempts[piece.name] = state.attempts.get(piece.name, 0) + 1
    state.restart(piece)
    if state.attempts[piece.name] >= max_attempts:
        return Verdict.REFUSE
    return Verdict.REFETCH


def parse_range_header(header: str | None, size_bytes: int) -> tuple[int, int] | None:
    """``Range: bytes=A-B`` (one range; ``A-`` and ``-N`` too) -> ``(start, end)`` with
    ``end`` exclusive, clipped to the file; None for no header. A server of model files
    answers a missing header with the whole file (200).

    Raises:
      ValueError: a header that is not one satisfiable byte range (answered 416).
    """
    if header is None:
        return None
    unit, sep, spec = header.strip().partition("=")
    if unit.strip().lower() != "bytes" or not sep or "," in spec:
        raise ValueError(f"only one byte range is served, got {header!r}")
    first, dash, last = spec.strip().partition("-")
    if not dash:
        raise ValueError(f"malformed range {header!r}")
    try:
        if not first:
            n = int(last)
            if n <= 0:
                raise ValueError
            return max(0, size_bytes - n), size_bytes
        start = int(first)
        end = size_bytes if not last else min(int(last) + 1, size_bytes)
    except ValueError:
        raise ValueError(f"malformed range {header!r}") from None
    if start < 0 or start >= size_bytes or end <= start:
        raise ValueError(f"range {header!r} is outside the file's {size_bytes} bytes")
    return start, end
