"""Read dataset pickles (CIFAR batches) without running code: only the globals those files need.

The official CIFAR batches are Python 2 pickles of a dict holding a uint8 numpy array, label lists, bytes
and strings. Rebuilding those needs numpy's array reconstruction and nothing else; any other global a
file names (os.system, builtins.eval, ...) is refused before it is called.

>>> import io, pickle
>>> load_restricted(io.BytesIO(pickle.dumps({b"labels": [1, 2]})), "x")
{b'labels': [1, 2]}
"""

from __future__ import annotations

import pickle

from toolkit.errors import UserError

ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),  # how numpy pickles an ndarray (numpy < 2 names)
    ("numpy._core.multiarray", "_reconstruct"),  # the same under numpy >= 2
    ("numpy.core.numeric", "_frombuffer"),  # protocol 5: an array from its raw buffer
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy.core.multiarray", "scalar"),  # a numpy number (labels saved as np.int64)
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # protocol 2 writes bytes as _codecs.encode(str, 'latin1')
}


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, name: str):
        super().__init__(file, encoding="bytes")
        self.name = name

    def find_class(self, module, name):
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise UserError(f"{self.name} asks to run {module}.{name}, which a dataset file never needs; it was "
                        "refused and nothing ran: fetch the dataset from its official source.")


def load_restricted(file, name: str):
    """Unpickle `file` (named `name` in errors) allowing only dicts, lists, numbers, bytes, strings and numpy
    arrays; a file naming any other global raises UserError without calling it."""
    return _RestrictedUnpickler(file, name).load()
