"""The confusion matrix as a picture: OUTPUT_DIR/confusion.png, drawn by the run's main process after its final
evaluation and after any evaluation a minute or more since the last drawing (`ConfusionPicture`).

Drawn with Pillow, which torchvision brings and the image loaders use: 20 ms a picture, where matplotlib takes
0.6 s (0.25 s to import, 0.35 s to lay out and draw; measured on a 2-core CPU) at the end of every run, while the
other ranks wait. A notebook's or a script's own plotting is left as it is.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

MAX_LABELLED = 40  # classes beyond which the cells' counts would be unreadable: the colour shows them alone
# How stale the picture may get: a run of short epochs draws the last evaluation's matrix, and a long run's picture
# is at most this old (confusion.json has every evaluation).
REDRAW_AFTER_S = 60
# ColorBrewer's 9-class "Blues" (matplotlib's "Blues" colormap): zero is near white, the largest count dark blue.
BLUES = [(247, 251, 255), (222, 235, 247), (198, 219, 239), (158, 202, 225), (107, 174, 214), (66, 146, 198),
         (33, 113, 181), (8, 81, 156), (8, 48, 107)]


class ConfusionPicture:
    """confusion.png at `path`: `update` draws the matrix when it is the final evaluation's or the last drawing
    (or the start) is REDRAW_AFTER_S old, else keeps it; `flush` draws a kept one (a run that stops early).

    >>> import tempfile
    >>> now = [0.0]
    >>> picture = ConfusionPicture(f"{tempfile.mkdtemp()}/confusion.png", clock=lambda: now[0])
    >>> picture.update([[1]], ["a"]); picture.path.exists()
    False
    >>> now[0] = 60.0; picture.update([[2]], ["a"]); picture.path.exists()
    True
    """

    def __init__(self, path, clock=time.monotonic):
        self.path, self.clock = Path(path), clock
        self.drawn_at, self.kept = clock(), None

    def update(self, matrix: list[list[int]], class_names: list[str], final: bool = False):
        self.kept = (matrix, class_names)
        if final or self.clock() - self.drawn_at >= REDRAW_AFTER_S:
            self.flush()

    def flush(self):
        if self.kept is not None:
            write_confusion(self.path, *self.kept)
            self.drawn_at, self.kept = self.clock(), None


def write_confusion(path_png, matrix: list[list[int]], class_names: list[str]) -> Path:
    """Draw `matrix` (rows: true class, columns: predicted; counts) as cells shaded by count, with each cell's
    count, the class names on the axes and a colour bar, and write it to `path_png` atomically (a viewer never
    reads half a file); returns the path.

    >>> import tempfile
    >>> path = write_confusion(f"{tempfile.mkdtemp()}/confusion.png", [[5, 1], [0, 3]], ["cat", "dog"])
    >>> path.read_bytes()[:8]
    b'\\x89PNG\\r\\n\\x1a\\n'
    """
    from PIL import Image, ImageDraw, ImageFont

    classes = len(matrix)
    high = max((max(row) for row in matrix), default=0)
    cell = max(12, min(48, 720 // max(classes, 1)))
    font = ImageFont.load_default(size=14)
    small = ImageFont.load_default(size=max(8, min(14, cell * 2 // 5)))
    label = max((font.getlength(name) for name in class_names), default=0)
    rotated = label > cell - 4  # the columns' names read bottom to top where they would not fit side by side
    left, top = int(label) + 40, 40
    bottom = top + classes * cell + (int(label) if rotated else 20) + 36
    width = left + classes * cell + 90
    image = Image.new("RGB", (max(width, 240), bottom), "white")
    draw = ImageDraw.Draw(image)
    title = f"confusion matrix ({sum(map(sum, matrix))} samples)"
    draw.text((image.width // 2, 12), title, fill="black", font=font, anchor="mt")
    for row, counts in enumerate(matrix):
        for column, count in enumerate(counts):
            x, y = left + column * cell, top + row * cell
            draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=shade(count / high if high else 0.0))
            if classes <= MAX_LABELLED:
                draw.text((x + cell / 2, y + cell / 2), str(count), font=small, anchor="mm",
                          fill="white" if count > high / 2 else "black")
    _axes(image, draw, font, class_names, (left, top, cell), rotated)
    _colour_bar(draw, font, (left + classes * cell + 20, top, classes * cell), high)
    path = Path(path_png)
    temp = path.with_name(f".{path.name}.tmp")
    image.save(temp, format="png")
    os.replace(temp, path)
    return path


def shade(fraction: float) -> tuple[int, int, int]:
    """The colour of `fraction` (0 to 1) of the largest count, interpolated along BLUES."""
    position = min(max(fraction, 0.0), 1.0) * (len(BLUES) - 1)
    low = min(int(position), len(BLUES) - 2)
    weight = position - low
    return tuple(round(a + (b - a) * weight) for a, b in zip(BLUES[low], BLUES[low + 1]))


def _axes(image, draw, font, class_names, grid, rotated):
    """The class names beside the rows and under the columns, and the axes' names "true" and "predicted"."""
    from PIL import Image, ImageDraw

    left, top, cell = grid
    end = top + len(class_names) * cell
    for index, name in enumerate(class_names):
        middle = top + index * cell + cell / 2
        draw.text((left - 6, middle), name, fill="black", font=font, anchor="rm")
        x = left + index * cell + cell / 2
        if rotated:
            strip = Image.new("L", (int(font.getlength(name)) + 2, 18), 0)
            ImageDraw.Draw(strip).text((0, 0), name, fill=255, font=font)
            strip = strip.rotate(90, expand=True)
            image.paste("black", (int(x - strip.width / 2), end + 6), strip)
        else:
            draw.text((x, end + 6), name, fill="black", font=font, anchor="mt")
    draw.text((left + len(class_names) * cell / 2, image.height - 8), "predicted", fill="black", font=font,
              anchor="mb")
    true = Image.new("L", (40, 18), 0)
    ImageDraw.Draw(true).text((0, 0), "true", fill=255, font=font)
    true = true.rotate(90, expand=True)
    image.paste("black", (6, int((top + end) / 2 - true.height / 2)), true)


def _colour_bar(draw, font, bar, high):
    """A vertical bar from 0 (bottom) to the largest count (top), with both numbers and the middle one."""
    x, top, height = bar
    for offset in range(height):
        draw.line((x, top + offset, x + 14, top + offset), fill=shade(1 - offset / max(height - 1, 1)))
    draw.rectangle((x, top, x + 14, top + height - 1), outline="black")
    for fraction in (0.0, 0.5, 1.0):
        value = high * fraction
        text = f"{value:g}" if fraction != 0.5 or high % 2 == 0 else f"{value:.1f}"
        draw.text((x + 20, top + (1 - fraction) * (height - 1)), text, fill="black", font=font, anchor="lm")
