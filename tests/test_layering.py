"""Imports run one way: config, segments <- ops <- layers <- model <- train; sharding (meshes and
rules) reads only ops' axis names. Read from the source, nothing imported or compiled."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "k3jax"
ALLOWED = {  # floor -> the k3jax floors its modules may import (their own included)
    "ops": {"ops", "segments", "config"},
    "layers": {"layers", "ops", "segments", "config"},
    "sharding": {"sharding", "ops", "config"},
}


def _imported_floors(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):  # lazy imports inside functions count too
        names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        out |= {n.split(".")[1] for n in names if n.startswith("k3jax.")}
    return out


@pytest.mark.parametrize("floor", sorted(ALLOWED))
def test_imports_run_one_way(floor):
    files = sorted((PKG / floor).rglob("*.py"))
    assert files
    bad = {str(p.relative_to(PKG)): sorted(_imported_floors(p) - ALLOWED[floor]) for p in files}
    assert not {k: v for k, v in bad.items() if v}, bad
