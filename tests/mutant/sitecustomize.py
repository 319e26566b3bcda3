"""Tests only: apply the injected bug named by $TOOLKIT_MUTATION (see tests/mutations.py) to every Python
process that has this folder on PYTHONPATH, torchrun and accelerate workers included. Without the variable
this does nothing."""

import importlib.machinery
import os
import sys

NAME = os.environ.get("TOOLKIT_MUTATION")


class _PatchOnImport:
    """A meta-path finder that lets the normal finder load `module`, then applies the patch to it."""

    def __init__(self, mutation):
        self.mutation = mutation

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.mutation.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader = spec.loader
        if callable(getattr(self.mutation.patch, "rewrite", None)):
            # A recipe's loop: its source is rewritten before it is compiled, whether it is imported or run with
            # `python -m recipes.NAME` (runpy asks the loader found here for the code).
            def edited_code(name):
                source = self.mutation.patch.rewrite(loader.get_source(name), self.mutation.target)
                code = compile(source, loader.get_filename(name), "exec", dont_inherit=True)
                _applied(fullname)
                return code

            loader.get_code = edited_code
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            self.mutation.apply(module)
            _applied(fullname)

        loader.exec_module = exec_and_patch
        return spec


def _applied(fullname):
    if os.environ.get("TOOLKIT_MUTATION_LOG"):
        with open(os.environ["TOOLKIT_MUTATION_LOG"], "a") as log:
            log.write(f"{NAME} applied to {fullname} in pid {os.getpid()}\n")


if NAME:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from mutations import MUTATIONS

    sys.path.pop(0)
    if NAME not in MUTATIONS:
        raise SystemExit(f"error: TOOLKIT_MUTATION={NAME} is not one of {', '.join(sorted(MUTATIONS))}.")
    sys.meta_path.insert(0, _PatchOnImport(MUTATIONS[NAME]))
