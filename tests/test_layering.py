"""Imports run one way, read from the source (nothing imported or compiled).

    k3jax:  config <- ops (+ segments, tree_paths) <- layers <- model (+ model_spec, model_sizes, decode,
            layout) <- the rest (interchange, flops, chips, kernel_paths, demo); sharding
            (meshes and rules) reads only ops' axis names and config
    train (the programs: trainer, planner, interchange of run directories, info) <- benchmarks
    tests may import anything; benchmarks/results/ holds records (one-off scripts of the runs
    there), which nothing imports and which are not checked.

Every import statement counts, at module level or inside a function: `import a.b`,
`from a import b` (b a module or a name), `from a.b import (c, d)`, relative imports, and a
benchmark's or test's bare `import name` of a file beside it (on sys.path). The graph of
k3jax/ and train/ modules has no cycle either.
"""

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("k3jax", "train", "benchmarks")  # tests/ may import anything
LOCAL = ("k3jax", "train", "benchmarks", "tests")

# module-name prefix -> floor (the longest matching prefix wins)
K3JAX_FLOORS = {
    "k3jax.config": "config",
    "k3jax.ops": "ops",
    "k3jax.segments": "ops",  # document ids of packed rows: the kernels' masks read them
    "k3jax.tree_paths": "ops",  # pytree key paths as plain keys: the sharding rules match leaves by them
    "k3jax.layers": "layers",
    "k3jax.sharding": "sharding",
    "k3jax.model": "model",
    "k3jax.model_spec": "model",
    "k3jax.model_sizes": "model",
    "k3jax.decode": "model",
    "k3jax.layout": "model",
    "k3jax": "library",  # the rest of k3jax
    "train": "train",
    "benchmarks": "benchmarks",
    "tests": "tests",
}
ALLOWED = {  # floor -> the floors its modules may import (their own included)
    "config": {"config"},
    "ops": {"ops", "config"},
    "layers": {"layers", "ops", "config"},
    "sharding": {"sharding", "ops", "config"},
    "model": {"model", "layers", "ops", "config"},
    "library": {"library", "model", "sharding", "layers", "ops", "config"},
    "train": {"train", "library", "model", "sharding", "layers", "ops", "config"},
    "benchmarks": {"benchmarks", "train", "library", "model", "sharding", "layers", "ops", "config"},
}
EXCEPTIONS = {  # (importing file, imported module): why it is allowed
    ("benchmarks/checks/kda_check.py", "tests.reference"):
        "the GPU check compares the kernels with the same float64 loop (delta_rule_loop) the CPU tests "
        "use, an independent reference that belongs to the tests",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for top in LOCAL for p in (ROOT / top).rglob("*.py")}


def _bare(name: str, importer: Path) -> str | None:
    """A bare `import name` of a benchmark or test: the file of that name beside the importer,
    else in its own top folder, else in tests/ (sys.path tricks); None for a third-party module."""
    if importer.relative_to(ROOT).parts[0] not in ("benchmarks", "tests"):
        return None
    top = name.split(".")[0]
    beside = importer.parent / f"{top}.py"
    if beside.exists():
        return _module_name(beside) + name[len(top):]
    for folder in (importer.relative_to(ROOT).parts[0], "tests"):
        found = sorted((ROOT / folder).rglob(f"{top}.py"))
        if len(found) == 1:
            return _module_name(found[0]) + name[len(top):]
    return None


def _resolve(name: str) -> str | None:
    """The local module `name` is, or lies in (a.b.c -> a.b when c is a name in a.b)."""
    modules = _modules()
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path) -> set[str]:
    """Every local module a file imports, by any form, anywhere in it."""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the importer's package, `level` - 1 packages up
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            # `from a import b` imports the module a.b when b is one, else a name in a
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] not in LOCAL:
                name = _bare(name, path)
            target = name and _resolve(name)
            if target:
                out.add(target)
    return out


def floor(module: str) -> str:
    best = max((p for p in K3JAX_FLOORS if module == p or module.startswith(p + ".")), key=len)
    return K3JAX_FLOORS[best]


RECORDS = "benchmarks/results"


def _files(top: str) -> list[Path]:
    return sorted(p for p in (ROOT / top).rglob("*.py") if not str(p.relative_to(ROOT)).startswith(RECORDS))


@pytest.mark.parametrize("top", CHECKED)
def test_imports_run_one_way(top):
    files = _files(top)
    assert files
    bad = {}
    for path in files:
        rel = str(path.relative_to(ROOT))
        allowed = ALLOWED[floor(_module_name(path))]
        wrong = sorted(m for m in imports(path) if floor(m) not in allowed and (rel, m) not in EXCEPTIONS)
        if wrong:
            bad[rel] = wrong
    assert not bad, bad


def test_nothing_imports_the_records():
    records = RECORDS.replace("/", ".")
    bad = {str(p.relative_to(ROOT)): sorted(m for m in imports(p) if m.startswith(records))
           for top in LOCAL for p in _files(top)}
    assert not {k: v for k, v in bad.items() if v}


def test_exceptions_are_still_needed():
    """An allowed exception that no file takes any more is removed from the list."""
    for rel, module in EXCEPTIONS:
        assert module in imports(ROOT / rel), (rel, module)


def test_every_import_form_is_caught(tmp_path, monkeypatch):
    """The reader against a file holding each form, with the floors it must find."""
    pkg = tmp_path / "k3jax" / "ops"
    pkg.mkdir(parents=True)
    (tmp_path / "k3jax" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    for name in ("a", "b"):
        (pkg / f"{name}.py").write_text("")
    (tmp_path / "k3jax" / "model.py").write_text("")
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "__init__.py").write_text("")
    (tmp_path / "train" / "setup.py").write_text("")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "util.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "reference.py").write_text("")
    src = pkg / "c.py"
    src.write_text("import os\nimport k3jax.model\nfrom k3jax import ops\nfrom . import a\nfrom .b import thing\n"
                   "def f():\n    from train.setup import (prepare,\n        other)\n    import numpy\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    _modules.cache_clear()
    try:
        assert imports(src) == {"k3jax.model", "k3jax.ops", "k3jax.ops.a", "k3jax.ops.b", "train.setup"}
        bench = tmp_path / "benchmarks" / "x.py"
        bench.write_text("import util\nfrom reference import loop\nimport json\n")
        assert imports(bench) == {"benchmarks.util", "tests.reference"}
    finally:
        _modules.cache_clear()


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): {m for m in imports(p) if m.split(".")[0] in ("k3jax", "train")}
            for top in ("k3jax", "train") for p in _files(top)}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph (a module path back to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if n == m:
                continue
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_import_graph_has_no_cycle():
    """k3jax/ and train/ modules, imports at module level and inside functions alike."""
    graph = _graph()
    assert len(graph) > 100
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
