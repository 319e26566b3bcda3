"""The confusion matrix as a picture: OUTPUT_DIR/confusion.png, drawn by the run's main process after its final
evaluation and after any evaluation a minute or more since the last drawing (`ConfusionPicture`).

matplotlib is imported when a picture is drawn, not with `toolkit`, and through its Agg canvas alone: no
pyplot, so a notebook's or a script's own backend and figures are left as they are.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

MAX_LABELLED = 40  # classes beyond which the cells' counts would be unreadable: the colour shows them alone
# How stale the picture may get: a drawing holds the main process 0.2 s (0.8 s for the first, importing
# matplotlib, measured on a 2-core CPU) while the other ranks wait at the next step, so a run of short epochs draws
# the last evaluation's matrix, and a long run's picture is at most this old (confusion.json has every evaluation).
REDRAW_AFTER_S = 60


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
    """Draw `matrix` (rows: true class, columns: predicted; counts) with each cell's count and the class names on
    the axes, and write it to `path_png` atomically (a viewer never reads half a file); returns the path.

    >>> import tempfile
    >>> path = write_confusion(f"{tempfile.mkdtemp()}/confusion.png", [[5, 1], [0, 3]], ["cat", "dog"])
    >>> path.read_bytes()[:8]
    b'\\x89PNG\\r\\n\\x1a\\n'
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    classes = len(matrix)
    size = min(3.0 + 0.45 * classes, 24.0)
    figure = Figure(figsize=(size + 1.0, size), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    image = axes.imshow(matrix, cmap="Blues", vmin=0)
    figure.colorbar(image, ax=axes, shrink=0.8)
    axes.set_xticks(range(classes), class_names, rotation=90 if classes > 10 else 0)
    axes.set_yticks(range(classes), class_names)
    axes.set_xlabel("predicted")
    axes.set_ylabel("true")
    axes.set_title(f"confusion matrix ({sum(map(sum, matrix))} samples)")
    if classes <= MAX_LABELLED:
        high = max(max(row) for row in matrix) if classes else 0
        for row, counts in enumerate(matrix):
            for column, count in enumerate(counts):
                axes.text(column, row, str(count), ha="center", va="center", fontsize=8 if classes > 10 else 10,
                          color="white" if count > high / 2 else "black")
    path = Path(path_png)
    temp = path.with_name(f".{path.name}.tmp")
    figure.savefig(temp, format="png", dpi=100)
    os.replace(temp, path)
    return path
