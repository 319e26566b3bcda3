"""Modules stay short (a file within 400 lines, a function within 60), and imports flow one way through the
toolkit's layers (STYLE.md): errors/config <- launch <- checkpoint <- engines <- data/models <- train <- plan <- check <- cli and the
package itself. Every import counts: at the top of a module or inside a function, `import toolkit.x`,
`from toolkit.x import y`, `from toolkit import x` and relative ones. A lower layer that needs to call up exposes
a hook instead (toolkit/engines/observers.py)."""

import ast
from pathlib import Path

TOOLKIT = Path(__file__).resolve().parents[1] / "toolkit"

# Bottom first. A module may import its own part and the parts of the rows below it; parts on one row (data and
# models) may import each other only while no cycle forms between them. "toolkit" is the package's __init__ alone;
# the recipes sit on top beside it (they are not scanned, but no toolkit module may import them).
LAYERS = [
    ("toolkit.errors", "toolkit.config"),
    ("toolkit.launch",),
    ("toolkit.checkpoint",),
    ("toolkit.engines",),
    ("toolkit.data", "toolkit.models"),
    ("toolkit.train",),
    ("toolkit.plan",),
    ("toolkit.check",),
    ("toolkit.use",),
    ("toolkit.cli", "toolkit", "recipes"),
]
ROW = {part: row for row, parts in enumerate(LAYERS) for part in parts}


def modules(root: Path) -> dict[str, Path]:
    """Every module under `root` (a `toolkit` folder) by its dotted name; a package by its __init__."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def part_of(module: str) -> str | None:
    """The layer part a module belongs to: the longest part naming it or a package above it."""
    if module == "toolkit":
        return "toolkit"
    parts = [p for p in ROW if p != "toolkit" and (module == p or module.startswith(p + "."))]
    return max(parts, key=len, default=None)


def imports_of(module: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported toolkit module) for every import in the file, function-level ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: climb from this module's package
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:  # `from toolkit import errors` imports the module toolkit.errors
                submodule = f"{base}.{alias.name}"
                found.append((node.lineno, submodule if submodule in known else base))
    return sorted((line, name) for line, name in found if name.split(".")[0] in ("toolkit", "recipes"))


def all_imports(root: Path) -> list[tuple[str, int, str]]:
    known = modules(root)
    return [(module, line, target)
            for module, path in known.items() for line, target in imports_of(module, path, known)]


def upward_imports(root: Path) -> list[str]:
    """`module -> imported module (line N)` for each import of a higher layer."""
    return [f"{module} -> {target} (line {line})" for module, line, target in all_imports(root)
            if ROW[part_of(target) or "toolkit"] > ROW[part_of(module) or "toolkit"]]


def part_cycles(root: Path) -> list[str]:
    """Each cycle in the graph of imports between parts, as `a -> b -> a`."""
    edges: dict[str, set[str]] = {}
    for module, _, target in all_imports(root):
        a, b = part_of(module), part_of(target)
        if a and b and a != b:
            edges.setdefault(a, set()).add(b)
    cycles, done = set(), set()

    def visit(part, path):
        if part in path:
            loop = path[path.index(part):]
            start = loop.index(min(loop))  # one spelling per cycle
            cycles.add(" -> ".join(loop[start:] + loop[:start] + [min(loop)]))
            return
        if part in done:
            return
        for nxt in sorted(edges.get(part, ())):
            visit(nxt, path + [part])
        done.add(part)

    for part in sorted(edges):
        visit(part, [])
    return sorted(cycles)


def test_every_module_has_a_layer():
    lost = [module for module in modules(TOOLKIT) if part_of(module) is None]
    assert not lost, f"modules outside every layer (add them to LAYERS): {lost}"


def test_no_module_imports_a_higher_layer():
    crossings = upward_imports(TOOLKIT)
    assert not crossings, "upward imports (a hook in the lower layer replaces them):\n" + "\n".join(crossings)


def test_no_import_cycle_between_layers():
    cycles = part_cycles(TOOLKIT)
    assert not cycles, "import cycles between layers:\n" + "\n".join(cycles)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "toolkit" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "toolkit"


def test_the_check_sees_every_kind_of_upward_import(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "from toolkit.engines import build\n",
        "errors.py": "def f():\n    from toolkit import engines\n",  # function-level, `from package import module`
        "config.py": "import toolkit.launch.env\nimport recipes.cifar\n",
        "launch/__init__.py": "", "launch/env.py": "from ..engines.base import x\n",  # relative
        "engines/__init__.py": "from . import base\n", "engines/base.py": "from toolkit.errors import f\n",
    })
    assert upward_imports(root) == ["toolkit.config -> toolkit.launch.env (line 1)",
                                    "toolkit.config -> recipes.cifar (line 2)",
                                    "toolkit.errors -> toolkit.engines (line 2)",
                                    "toolkit.launch.env -> toolkit.engines.base (line 1)"]


def test_the_check_sees_a_cycle_between_parts_of_one_row(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "", "data/__init__.py": "from toolkit.models import nets\n",
        "models/__init__.py": "", "models/nets.py": "def f():\n    import toolkit.data\n",
    })
    assert upward_imports(root) == []
    assert part_cycles(root) == ["toolkit.data -> toolkit.models -> toolkit.data"]


def state_json_builders(root: Path) -> list[str]:
    """Each function that builds state.json's dict: a dict display holding both "world_size" and "dataloaders"."""
    found = []
    for module, path in modules(root).items():
        tree = ast.parse(path.read_text())
        for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(function):
                keys = {k.value for k in getattr(node, "keys", ()) if isinstance(k, ast.Constant)}
                if isinstance(node, ast.Dict) and {"world_size", "dataloaders"} <= keys:
                    found.append(f"{module}.{function.name}")
    return sorted(set(found))


def test_state_json_is_built_in_one_function():
    assert state_json_builders(TOOLKIT) == ["toolkit.checkpoint.files.training_state"]


def test_the_check_sees_a_second_state_json_builder(tmp_path):
    root = _tree(tmp_path, {"__init__.py": "", "a.py": "def f():\n    return {'world_size': 1, 'dataloaders': []}\n",
                            "b.py": "def g(n):\n    x = {'step': 0, 'world_size': n, 'dataloaders': [1]}\n"})
    assert state_json_builders(root) == ["toolkit.a.f", "toolkit.b.g"]


MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60  # a file and a function one reads in one sitting


def too_long(root: Path) -> list[str]:
    """Each module over MAX_FILE_LINES lines and each function over MAX_FUNCTION_LINES, as `name: lines`."""
    found = []
    for module, path in modules(root).items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            found.append(f"{module}: {len(text.splitlines())}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{module}.{node.name}: {length}")
    return found


def test_no_module_is_over_400_lines_and_no_function_over_60():
    """The recipes' main() is the one exception: the loop reads top to bottom there, on purpose (STYLE.md)."""
    assert too_long(TOOLKIT) == []


def test_the_check_sees_a_long_module_and_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    root = _tree(tmp_path, {"__init__.py": "", "a.py": "def f():\n" + body, "b.py": "y = 0\n" * 401,
                            "c.py": "def g():\n" + body[:-len("    x59 = 59\n")]})
    assert too_long(root) == ["toolkit.a.f: 61", "toolkit.b: 401"]


ENGINE_NAMES = ("accelerator", "engine")  # what the toolkit's code calls an engine it is handed


def private_engine_reads(root: Path) -> list[str]:
    """Each read of an engine's `_`-prefixed attribute (`accelerator._models`, `self.accelerator._x`, `engine._y`;
    dunders aside) in a module outside toolkit.engines, as `module:line: accelerator._name`."""
    found = []
    for module, path in modules(root).items():
        if module == "toolkit.engines" or module.startswith("toolkit.engines."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else None
            if name in ENGINE_NAMES:
                found.append((module, node.lineno, f"{name}.{node.attr}"))
    return [f"{module}:{line}: {read}" for module, line, read in sorted(found)]


def test_no_module_outside_the_engines_reads_an_engines_private_attribute():
    """The training parts, the checks and the CLI use the Accelerator API an engine shares with Accelerate's own
    class, so they work over either (TrainingRun included)."""
    assert private_engine_reads(TOOLKIT) == []


def test_the_check_sees_private_reads_of_an_engine_outside_the_engines(tmp_path):
    root = _tree(tmp_path, {"__init__.py": "", "engines/__init__.py": "x = accelerator._models\n",
                            "train/__init__.py": "", "train/run.py": (
                                "def f(self, accelerator, engine):\n    a = self.accelerator._custom_objects\n"
                                "    b = accelerator._optimizers[0]\n    c = engine._wrap_model\n"
                                "    d = accelerator.__class__\n    e = self._accelerator\n")})
    assert private_engine_reads(root) == ["toolkit.train.run:2: accelerator._custom_objects",
                                          "toolkit.train.run:3: accelerator._optimizers",
                                          "toolkit.train.run:4: engine._wrap_model"]


def engine_structure(base: type, engines: list[type]) -> list[str]:
    """How `engines` build on `base`, as problems: an engine over another engine (ddp and fsdp are siblings:
    each is `base` plus parts that are not engines), a hook defined twice along one engine's own classes (its
    parts included), and a hook `base`'s docstring does not name."""
    problems, inherited = [], set().union(*(vars(c) for c in base.__mro__))
    for engine in engines:
        own = [c for c in engine.__mro__ if c not in base.__mro__]
        problems += [f"{c.__name__} builds on the engine {b.__name__}" for c in own for b in c.__bases__
                     if b is not base and issubclass(b, base)]
        defined = {}
        for part in own:
            for name in vars(part):
                if name in inherited and name != "name" and not name.startswith("__"):
                    defined.setdefault(name, []).append(part.__name__)
        for name, parts in sorted(defined.items()):
            if len(parts) > 1:
                problems.append(f"{engine.__name__}.{name} is defined in {', '.join(parts)}")
            if f"`{name}`" not in (base.__doc__ or ""):
                problems.append(f"{engine.__name__}.{name} is not a hook {base.__name__}'s docstring names")
    return problems


def test_the_engines_are_siblings_with_each_hook_defined_once_and_named_in_the_base():
    from toolkit.engines.base import TorchEngine
    from toolkit.engines.ddp import RawDDPEngine
    from toolkit.engines.dp import DataParallelEngine
    from toolkit.engines.fsdp import FSDPEngine
    from toolkit.engines.single import SingleEngine

    assert engine_structure(TorchEngine, [SingleEngine, DataParallelEngine, RawDDPEngine, FSDPEngine]) == []
    assert max(len([c for c in e.__mro__ if issubclass(c, TorchEngine)]) for e in (RawDDPEngine, FSDPEngine)) == 2


def test_the_check_sees_an_engine_over_an_engine_a_hook_twice_and_an_unnamed_one():
    class Base:
        """Hooks: `_wrap`."""

        def _wrap(self): ...
        def _sync(self): ...

    class Group:
        def _sync(self): ...

    class First(Base):
        def _wrap(self): ...

    class Second(Group, First):
        def _wrap(self): ...

    assert engine_structure(Base, [First, Second]) == [
        "Second builds on the engine First", "Second._sync is not a hook Base's docstring names",
        "Second._wrap is defined in Second, First"]


FOLDER_MODULE = "toolkit.checkpoint.folder"


def folder_writers(root: Path) -> list[str]:
    """Calls of seal() or publish() (what makes a folder a checkpoint: its manifest, its name) outside the
    folder module, as `module:line: call`: every writer goes through its building()."""
    found = []
    for module, path in modules(root).items():
        if module == FOLDER_MODULE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in ("seal", "publish"):
                    found.append(f"{module}:{node.lineno}: {name}")
    return found


def test_every_checkpoint_folder_is_sealed_and_published_in_one_place():
    """The engines' save_state (full and sharded, the accelerate engine's too), the functional API and
    `toolkit checkpoint consolidate` all build their folder in toolkit/checkpoint/folder.py's building()."""
    assert folder_writers(TOOLKIT) == []


def test_the_check_sees_a_folder_sealed_or_published_by_hand(tmp_path):
    root = _tree(tmp_path, {"__init__.py": "", "checkpoint/__init__.py": "", "checkpoint/folder.py": "seal(x, {})\n",
                            "train/__init__.py": "", "train/save.py": (
                                "def save(temp, final):\n    seal(temp, {})\n    folder.publish(temp, final)\n")})
    assert folder_writers(root) == ["toolkit.train.save:2: seal", "toolkit.train.save:3: publish"]


# What creates, publishes, prunes or reads a checkpoint folder's files. Outside toolkit/checkpoint/ code calls
# the package's own entry points (write_full, read_rest, load_checkpoint, model_weights, ...) instead.
FOLDER_IO = {"building", "start_folder", "seal", "publish", "remove_folder", "remove_leftovers", "prune_checkpoints",
             "make_room", "write_full_weights", "save_sharded", "write_training_state", "load_full_weights",
             "load_shards", "read_whole", "read_index", "restore_rng", "load_safe", "verify_folder"}


def calls(root: Path, names: set[str]) -> list[tuple[str, int, str]]:
    """Every call of a function named in `names` (by name or attribute) in the modules under `root`, as
    (module, line, name)."""
    found = []
    for module, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in names:
                    found.append((module, node.lineno, name))
    return sorted(found)


def checkpoint_io_outside(root: Path) -> list[str]:
    """Calls of FOLDER_IO from modules outside the checkpoint package, as `module:line: call`."""
    return [f"{module}:{line}: {name}" for module, line, name in calls(root, FOLDER_IO)
            if not (module == "toolkit.checkpoint" or module.startswith("toolkit.checkpoint."))]


# Inside the package: a folder is built only in state.py (and by sharded.py's save_sharded, which state.write_sharded
# calls, around every rank's shards), and only state.py reads schedulers, scaler, registered objects and RNG streams.
ONE_WRITER = {"building": {"toolkit.checkpoint.state", "toolkit.checkpoint.sharded"},
              "write_training_state": {"toolkit.checkpoint.state"}, "restore_rng": {"toolkit.checkpoint.state"}}


def writers_and_readers(root: Path) -> dict[str, set[str]]:
    """The modules that call each of ONE_WRITER's functions."""
    found = {name: set() for name in ONE_WRITER}
    for module, _, name in calls(root, set(ONE_WRITER)):
        found[name].add(module)
    return found


def test_one_module_builds_every_checkpoint_folder_and_reads_what_it_holds_besides_weights():
    assert writers_and_readers(TOOLKIT) == ONE_WRITER


def test_the_check_sees_a_second_folder_writer_inside_the_package(tmp_path):
    root = _tree(tmp_path, {"__init__.py": "", "checkpoint/__init__.py": "", "checkpoint/state.py": (
        "with building(f, {}) as t:\n    write_training_state(t)\nrestore_rng(p, 0)\n"),
        "checkpoint/sharded.py": "with folder.building(f, {}):\n    pass\n",
        "checkpoint/consolidate.py": "with building(f, {}) as t:\n    pass\n"})
    assert writers_and_readers(root) == {**ONE_WRITER, "building": {
        "toolkit.checkpoint.state", "toolkit.checkpoint.sharded", "toolkit.checkpoint.consolidate"}}


def test_only_the_checkpoint_package_creates_publishes_prunes_or_reads_a_checkpoint_folder():
    assert checkpoint_io_outside(TOOLKIT) == []


def test_the_check_sees_folder_io_outside_the_checkpoint_package(tmp_path):
    root = _tree(tmp_path, {"__init__.py": "", "checkpoint/__init__.py": "", "checkpoint/folder.py": "seal(x, {})\n",
                            "checkpoint/state.py": "load_safe(p)\n", "engines/__init__.py": "", "engines/save.py": (
                                "def save(final, temp):\n    with folder.building(final, {}) as temp:\n"
                                "        write_full_weights(temp, [])\n"),
                            "use/__init__.py": "", "use/read.py": "def read(p):\n    return [load_safe(p), restore_rng(p, 0)]\n"})
    assert checkpoint_io_outside(root) == ["toolkit.engines.save:2: building", "toolkit.engines.save:3: write_full_weights",
                                           "toolkit.use.read:2: load_safe", "toolkit.use.read:2: restore_rng"]
