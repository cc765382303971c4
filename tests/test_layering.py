"""The package's layers point one way: engine -> executor -> worker. The engine holds only the
step's types from the worker (``worker.step``) and reaches rank 0 through the executor; the
executor never imports the engine back. Checked on the import graph (every ``import`` and
``from ... import``, also inside functions), not on strings."""

from __future__ import annotations

import ast
from pathlib import Path

import pagedserve

PACKAGE = Path(pagedserve.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved; ``from a import b`` counts as
    ``a.b`` too, as ``b`` may be a submodule."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def imports_under(folder: str) -> dict[str, set[str]]:
    return {module_name(p): imported_modules(p)
            for p in sorted((PACKAGE / folder).rglob("*.py"))}


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_resolver_sees_relative_and_function_level_imports(tmp_path, monkeypatch):
    """The checks below are only as good as the graph: a relative import, one inside a
    function, and a ``from package import module`` all show up."""
    root = tmp_path / "pagedserve" / "engine"
    root.mkdir(parents=True)
    (root / "probe.py").write_text(
        "from ..worker import model_runner\n"
        "def f():\n"
        "    import pagedserve.worker.input_batch\n"
        "    from . import stats\n")
    monkeypatch.setattr(f"{__name__}.PACKAGE", tmp_path / "pagedserve")
    found = imported_modules(root / "probe.py")
    assert {"pagedserve.worker.model_runner", "pagedserve.worker.input_batch",
            "pagedserve.engine.stats"} <= found


def test_the_engine_imports_only_the_step_types_of_the_worker():
    offending = {module: sorted(m for m in imported if within(m, "pagedserve.worker")
                                and not within(m, "pagedserve.worker.step"))
                 for module, imported in imports_under("engine").items()}
    assert {m: found for m, found in offending.items() if found} == {}


def test_the_executor_does_not_import_the_engine():
    offending = {module: sorted(m for m in imported if within(m, "pagedserve.engine"))
                 for module, imported in imports_under("executor").items()}
    assert {m: found for m, found in offending.items() if found} == {}


def test_the_platforms_and_the_weight_forms_do_not_import_the_config():
    """The config imports the platform and format registries (for their names); what they
    raise or check comes from ``errors``, the bottom layer, not back from the config."""
    offending = {module: sorted(m for m in imported if within(m, "pagedserve.config"))
                 for folder in ("platforms", "quant")
                 for module, imported in imports_under(folder).items()}
    assert {m: found for m, found in offending.items() if found} == {}
    assert not any(within(m, "pagedserve") for m in imported_modules(PACKAGE / "errors.py"))


def test_the_engine_reaches_rank_0_through_the_executor_s_calls_only():
    """No ``executor.runner`` (or ``executor.driver``) attribute chain in ``engine/``: what
    the engine needs of rank 0 is an executor method, so a remote rank 0 stays possible."""
    offending = []
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in ("runner", "driver")
                    and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "executor"):
                offending.append(f"{path.name}:{node.lineno}")
    assert offending == []
