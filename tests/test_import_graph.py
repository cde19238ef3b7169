"""The layering, checked on the source: every import (top-level, in functions, under TYPE_CHECKING)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "featurestore"
BACKENDS = {"featurestore.online.redis_single", "featurestore.online.redis_cluster"}
ENGINES = ("featurestore.materialization", "featurestore.retrieval", "featurestore.aggregation")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, ``from a import b`` counted as both ``a`` and ``a.b``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


GRAPH = {_module(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _importing(module: str, prefix: str) -> set[str]:
    return {name for name in GRAPH[module] if name == prefix or name.startswith(prefix + ".")}


def test_the_graph_covers_the_package():
    assert {"featurestore.feature_store", "featurestore.online.redis_store", *BACKENDS} <= set(GRAPH)


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith("featurestore.online.")))
def test_the_online_store_reads_no_repo_config_and_no_backend_imports_another(module):
    assert not _importing(module, "featurestore.config"), "online stores are given OnlineStoreSettings"
    for layer in ("featurestore.materialization", "featurestore.retrieval", "featurestore.registry"):
        assert not _importing(module, layer), f"{module} reaches up into {layer}"
    if module in BACKENDS or module == "featurestore.online.redis_store":
        others = BACKENDS - {module}
        assert not {name for name in GRAPH[module] if any(name.startswith(o) for o in others)}


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.startswith(ENGINES)))
def test_no_engine_imports_the_facade(module):
    assert not _importing(module, "featurestore.feature_store")


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_the_library_never_imports_the_apps(module):
    assert not _importing(module, "serving")


def test_the_checks_see_a_violation(tmp_path):
    """The walker itself: an import inside a function under TYPE_CHECKING is found."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    if True:\n        from serving.common import x\n")
    assert "serving.common" in _imports(source) and "serving.common.x" in _imports(source)
