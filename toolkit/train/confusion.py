"""The confusion matrix as a picture: OUTPUT_DIR/confusion.png, written by the run after each evaluation.

matplotlib is imported when a picture is drawn, not with `toolkit`, and through its Agg canvas alone: no
pyplot, so a notebook's or a script's own backend and figures are left as they are.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_LABELLED = 40  # classes beyond which the cells' counts would be unreadable: the colour shows them alone


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
