"""Generated text as it streams: UTF-8 whole at every token boundary, stop strings cut exactly.

Owns the owner-side text rules of a completion (the relay):
- token pieces arrive as bytes (a piece may end inside a UTF-8 character: emoji, CJK); the text
  handed out only ever holds whole characters, and invalid bytes become U+FFFD;
- stop strings (OpenAI's ``stop``) are cut exactly, also when one spans several tokens: text
  that could still be the start of a stop string is held back until it cannot be;
- once a stop string is seen, the stream has stopped: nothing after it is ever handed out;
- ``whole_utf8``: the text of some bytes up to a character they end inside (a detokenized run).

Pure: ``codecs`` only. Must not import trio, sockets, clocks or agent.io.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

__all__ = ["TextStream", "whole_utf8"]


class TextStream:
    """Feed token pieces with ``feed``; each call returns the text that may be shown now.

    Loop: ``for piece in pieces: out += stream.feed(piece); if stream.stopped: break``, then
    ``out += stream.finish()``. ``text`` is everything handed out so far.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        stops = tuple(s for s in stop if s)
        if len(stops) != len(tuple(stop)):
            raise ValueError("a stop string must not be empty")
        self.stop = stops
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the stream
        self.text = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded, not yet handed out: it may be the start of a stop string
        self._longest_stop = max((len(s) for s in stops), default=0)

    def feed(self, piece: bytes) -> str:
        """Take one token's bytes; the text that is now certain (possibly "")."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(piece)
        return self._release(final=False)

    def finish(self) -> str:
        """The end of the generation: the rest of the text (an unfinished character as U+FFFD)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        pending = self._pending
        cut = self._first_stop(pending)
        if cut is not None:
            index, stop = cut
            out = pending[:index]
            self.stopped = True
            self.stop_string = stop
            self._pending = ""
        elif final or not self.stop:
            out = pending
            self._pending = ""
        else:
            hold = self._held_back(pending)
            out = pending[: len(pending) - hold]
            self._pending = pending[len(pending) - hold :]
        self.text += out
        return out

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = text.find(stop)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _held_back(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        for length in range(min(len(text), self._longest_stop - 1), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self.stop):
                return length
        return 0


def whole_utf8(data: bytes) -> str:
    """The text of ``data`` up to a character it ends inside (held back until its bytes come);
    bytes that can never be UTF-8 become U+FFFD, as a final decode shows them."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)
