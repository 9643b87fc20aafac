"""A bar chart as a PNG, with the standard library only (zlib + struct): no matplotlib.

Owns: an RGB canvas (rectangles, lines, text in a built-in 5x7 pixel font), the PNG encoder
(signature, IHDR, one IDAT, IEND; 8-bit RGB, filter 0), and ``bar_chart_png``: bars with
min-max error bars, value labels, a y axis with ticks and wrapped labels under the bars.
Pure: returns bytes, writes no files.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence

__all__ = ["Canvas", "bar_chart_png", "encode_png"]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

Color = tuple[int, int, int]

# 5x7 glyphs, one string of 7 rows of 5 bits each; lower case is drawn as upper case.
_GLYPHS = {
    "A": "01110 10001 10001 11111 10001 10001 10001",
    "B": "11110 10001 10001 11110 10001 10001 11110",
    "C": "01110 10001 10000 10000 10000 10001 01110",
    "D": "11100 10010 10001 10001 10001 10010 11100",
    "E": "11111 10000 10000 11110 10000 10000 11111",
    "F": "11111 10000 10000 11110 10000 10000 10000",
    "G": "01110 10001 10000 10111 10001 10001 01111",
    "H": "10001 10001 10001 11111 10001 10001 10001",
    "I": "01110 00100 00100 00100 00100 00100 01110",
    "J": "00111 00010 00010 00010 00010 10010 01100",
    "K": "10001 10010 10100 11000 10100 10010 10001",
    "L": "10000 10000 10000 10000 10000 10000 11111",
    "M": "10001 11011 10101 10101 10001 10001 10001",
    "N": "10001 10001 11001 10101 10011 10001 10001",
    "O": "01110 10001 10001 10001 10001 10001 01110",
    "P": "11110 10001 10001 11110 10000 10000 10000",
    "Q": "01110 10001 10001 10001 10101 10010 01101",
    "R": "11110 10001 10001 11110 10100 10010 10001",
    "S": "01111 10000 10000 01110 00001 00001 11110",
    "T": "11111 00100 00100 00100 00100 00100 00100",
    "U": "10001 10001 10001 10001 10001 10001 01110",
    "V": "10001 10001 10001 10001 10001 01010 00100",
    "W": "10001 10001 10001 10101 10101 10101 01010",
    "X": "10001 10001 01010 00100 01010 10001 10001",
    "Y": "10001 10001 01010 00100 00100 00100 00100",
    "Z": "11111 00001 00010 00100 01000 10000 11111",
    "0": "01110 10001 10011 10101 11001 10001 01110",
    "1": "00100 01100 00100 00100 00100 00100 01110",
    "2": "01110 10001 00001 00010 00100 01000 11111",
    "3": "11111 00010 00100 00010 00001 10001 01110",
    "4": "00010 00110 01010 10010 11111 00010 00010",
    "5": "11111 10000 11110 00001 00001 10001 01110",
    "6": "00110 01000 10000 11110 10001 10001 01110",
    "7": "11111 00001 00010 00100 01000 01000 01000",
    "8": "01110 10001 10001 01110 10001 10001 01110",
    "9": "01110 10001 10001 01111 00001 00010 01100",
    " ": "00000 00000 00000 00000 00000 00000 00000",
    ".": "00000 00000 00000 00000 00000 01100 01100",
    ",": "00000 00000 00000 00000 01100 00100 01000",
    "-": "00000 00000 00000 11111 00000 00000 00000",
    "/": "00000 00001 00010 00100 01000 10000 00000",
    ":": "00000 01100 01100 00000 01100 01100 00000",
    "(": "00010 00100 01000 01000 01000 00100 00010",
    ")": "01000 00100 00010 00010 00010 00100 01000",
    "=": "00000 00000 11111 00000 11111 00000 00000",
    "?": "01110 10001 00001 00010 00100 00000 00100",
    "_": "00000 00000 00000 00000 00000 00000 11111",
    "+": "00000 00100 00100 11111 00100 00100 00000",
    "%": "11001 11010 00010 00100 01000 01011 10011",
}
_GLYPH_W, _GLYPH_H = 5, 7


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """An 8-bit RGB PNG of ``width`` x ``height`` pixels from row-major RGB bytes."""
    if width < 1 or height < 1 or len(rgb) != width * height * 3:
        raise ValueError(f"need {width}x{height}x3 bytes of RGB, got {len(rgb)}")
    stride = width * 3
    raw = b"".join(b"\x00" + bytes(rgb[y * stride : (y + 1) * stride]) for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")


class Canvas:
    """An RGB image in memory; coordinates are pixels from the top left, clipped to the image."""

    def __init__(self, width: int, height: int, background: Color = (255, 255, 255)) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """Fill ``[x0, x1) x [y0, y1)``."""
        x0, x1 = max(0, min(x0, x1)), min(self.width, max(x0, x1))
        y0, y1 = max(0, min(y0, y1)), min(self.height, max(y0, y1))
        if x0 >= x1:
            return
        row = bytes(color) * (x1 - x0)
        for y in range(y0, y1):
            start = (y * self.width + x0) * 3
            self.pixels[start : start + len(row)] = row

    def hline(self, x0: int, x1: int, y: int, color: Color, thickness: int = 1) -> None:
        self.rect(x0, y, x1 + 1, y + thickness, color)

    def vline(self, x: int, y0: int, y1: int, color: Color, thickness: int = 1) -> None:
        self.rect(x, min(y0, y1), x + thickness, max(y0, y1) + 1, color)

    @staticmethod
    def text_width(text: str, scale: int = 1) -> int:
        return len(text) * (_GLYPH_W + 1) * scale - scale if text else 0

    def text(self, x: int, y: int, text: str, color: Color = (0, 0, 0), scale: int = 1) -> None:
        """Draw ``text`` with its top left at (x, y); unknown characters are drawn as '?'."""
        for ch in text.upper():
            rows = _GLYPHS.get(ch, _GLYPHS["?"]).split()
            for gy, bits in enumerate(rows):
                for gx, bit in enumerate(bits):
                    if bit == "1":
                        self.rect(x + gx * scale, y + gy * scale, x + (gx + 1) * scale, y + (gy + 1) * scale, color)
            x += (_GLYPH_W + 1) * scale

    def centered_text(self, cx: int, y: int, text: str, color: Color = (0, 0, 0), scale: int = 1) -> None:
        self.text(cx - self.text_width(text, scale) // 2, y, text, color, scale)

    def png(self) -> bytes:
        return encode_png(self.width, self.height, self.pixels)


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = span / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * magnitude:
            return m * magnitude
    return 10 * magnitude


def _wrap(label: str, max_chars: int) -> list[str]:
    lines: list[str] = []
    for word in label.split():
        if lines and len(lines[-1]) + 1 + len(word) <= max_chars:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return lines or [""]


def bar_chart_png(
    bars: Sequence[tuple[str, float, float, float, Color]],
    *,
    title: str,
    y_label: str,
    legend: Sequence[tuple[str, Color]] = (),
    width: int = 960,
    height: int = 540,
) -> bytes:
    """A PNG bar chart: ``bars`` are ``(label, value, low, high, color)``; ``low``/``high``
    draw an error bar (e.g. min and max over runs); ``legend``: ``(text, color)`` entries drawn
    at the top right. Values must be >= 0."""
    if not bars:
        raise ValueError("no bars")
    c = Canvas(width, height)
    ink, grid, scale = (30, 30, 30), (225, 225, 225), 2
    left, right, top, bottom = 90, 20, 60, 110
    plot_w, plot_h = width - left - right, height - top - bottom
    c.centered_text(width // 2, 18, title, ink, scale)
    top_value = max(max(b[1], b[3]) for b in bars) or 1.0
    step = _nice_step(top_value * 1.1)
    y_max = step * math.ceil(top_value * 1.1 / step)

    def y_of(value: float) -> int:
        return top + plot_h - round(plot_h * max(0.0, value) / y_max)

    ticks = round(y_max / step)
    for i in range(ticks + 1):
        v = i * step
        y = y_of(v)
        c.hline(left, left + plot_w, y, grid)
        tick = f"{v:g}"
        c.text(left - 8 - c.text_width(tick, scale), y - 7, tick, ink, scale)
    c.vline(left, top, top + plot_h, ink, 2)
    c.hline(left, left + plot_w, top + plot_h, ink, 2)
    # the y label, written horizontally above the axis (the font has no rotation)
    c.text(8, top - 24, y_label, ink, 1)
    x = width - right
    for text, color in reversed(legend):
        x -= c.text_width(text, 1) + 24
        c.rect(x, top - 26, x + 10, top - 16, color)
        c.text(x + 14, top - 25, text, ink, 1)

    slot = plot_w / len(bars)
    bar_w = max(4, int(slot * 0.55))
    for i, (label, value, low, high, color) in enumerate(bars):
        cx = round(left + slot * (i + 0.5))
        c.rect(cx - bar_w // 2, y_of(value), cx + bar_w // 2, top + plot_h, color)
        if high > low:
            c.vline(cx - 1, y_of(high), y_of(low), ink, 2)
            c.hline(cx - 8, cx + 8, y_of(high) - 1, ink, 2)
            c.hline(cx - 8, cx + 8, y_of(low) - 1, ink, 2)
        c.centered_text(cx, y_of(high) - 22, f"{value:.1f}", ink, scale)
        max_chars = max(4, int(slot // ((_GLYPH_W + 1) * scale)))
        for j, line in enumerate(_wrap(label, max_chars)[:4]):
            c.centered_text(cx, top + plot_h + 12 + j * 20, line, ink, scale)
    return c.png()
