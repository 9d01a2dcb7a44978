"""The layering and documentation rules of the codebase (docs/architecture.md), checked on the tracked files:
model/ never imports service/, the engines import no Ray, no module imports another's private names, every
product file has its row in the architecture map, and the performance reference stays a reference."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUR_PACKAGES = ("model", "service", "benchmarks", "loadtests", "scripts")


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / p for p in out.stdout.split()]


def imports(tree: ast.AST) -> list[tuple[int, str, list[str], list[str]]]:
    """(line, module, imported names, the local names bound) for every absolute import in a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, [], [a.asname or a.name.split(".")[0]]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module, [a.name for a in node.names],
                          [a.asname or a.name for a in node.names]))
    return found


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


PYTHON = tracked(*(f"{p}/*.py" for p in OUR_PACKAGES))  # outside a git checkout, git fails loudly


def test_no_module_imports_another_modules_private_names():
    bad = []
    for path in PYTHON:
        tree = ast.parse(path.read_text(), str(path))
        modules = {}  # local name -> our module it stands for
        for line, module, names, bound in imports(tree):
            if module.split(".")[0] not in OUR_PACKAGES:
                continue
            bad += [f"{path.relative_to(ROOT)}:{line} imports {module}.{n}" for n in names if private(n)]
            modules.update(dict.fromkeys(bound, module))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in modules):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} reads {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(("folder", "forbidden"), [("model", "service"), ("service/engine", "ray")])
def test_layering(folder, forbidden):
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for path in tracked(f"{folder}/*.py")
           for line, module, _, _ in imports(ast.parse(path.read_text()))
           if module.split(".")[0] == forbidden]
    assert not bad, "\n".join(bad)


def test_the_architecture_map_names_every_product_file():
    doc = (ROOT / "docs/architecture.md").read_text()
    missing = [str(p.relative_to(ROOT)) for p in tracked("model/*.py", "service/*.py")
               if p.name != "__init__.py" and f"`{p.relative_to(ROOT)}`" not in doc and f"`{p.name}`" not in doc]
    assert not missing, f"docs/architecture.md has no row for: {missing}"


def test_docs_are_reference_not_logs():
    assert len((ROOT / "docs/performance.md").read_text().splitlines()) <= 400
    logs = [str(p.relative_to(ROOT)) for p in tracked("docs/*") if p.suffix in (".log", ".jsonl")]
    assert not logs, f"training or session logs belong outside docs/: {logs}"
