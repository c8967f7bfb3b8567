"""The package's layers (README.md, "Layout"): imports run one way, and there is no circle.

Read from the source with `ast` (every import, module-level or inside a function), not by importing:
a lazy import inside a function is still a dependency that a change has to respect."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "verl_arpo"


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """verl_arpo modules `path` imports: `from a.b import c` is a.b.c when that is a module (a
    package's __init__ is not a dependency of the submodules taken from it), else a.b."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module(path).split(".")
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: from the package this module is in
                base = here[:len(here) - node.level + (1 if is_pkg else 0)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            for a in node.names:
                out.add(f"{name}.{a.name}" if f"{name}.{a.name}" in modules else name)
    return {m for m in out if m in modules}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PKG.rglob("*.py") if "_bundled" not in p.parts}
    return {m: _imports(p, set(files)) - {m} for m, p in files.items()}


def test_the_config_and_the_algorithms_import_nothing_above_them(graph):
    up = {m: sorted(i for i in deps if i.startswith(("verl_arpo.trainer", "verl_arpo.workers", "verl_arpo.algos"))
                    and not (m.startswith("verl_arpo.algos") and i.startswith("verl_arpo.algos")))
          for m, deps in graph.items() if m.startswith(("verl_arpo.config", "verl_arpo.algos"))}
    assert {m: d for m, d in up.items() if d} == {}
    assert {m for m in graph if m.startswith("verl_arpo.config.")} >= {"verl_arpo.config.typed", "verl_arpo.config.run"}


def test_no_import_circle(graph):
    """Tarjan's strongly connected components over the module graph: each must be one module."""
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert circles == []


def test_verls_import_path_is_the_same_module():
    from verl_arpo.algos import core_algos
    from verl_arpo.trainer.ppo import core_algos as via_verl_path

    assert via_verl_path is core_algos and "grpo" in via_verl_path.ADV_ESTIMATOR_REGISTRY


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore is its module's own: a module that needs it from another
    module needs it public (issue 50). Module-level dunders (__version__) are not private."""
    found = []
    for path in PKG.rglob("*.py"):
        if "_bundled" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("verl_arpo")):
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private:
                    found.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.module} {private}")
    assert found == []
