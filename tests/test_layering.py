"""Imports only point down, and no module reaches into another's private names.

The layers, lowest first. A module may import its own layer and the layers below it, never above,
at module level or inside a function (a lazy import is still a dependency). Every module under
dspark/ must be placed; a module belongs to the longest prefix listed (`dspark` alone means the
package's __init__, which re-exports the api). docs/architecture.md says what each layer owns.
"""

import ast
from pathlib import Path

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("dspark.errors", "dspark.sampling", "dspark.verify", "dspark.stats")),
    # the target and its tokenizer (text needs LoadedTarget); drafters.files (checkpoint file names, shard
    # index) is read by loading too; cli_args reads loading's dtype names
    ("models", ("dspark.drafters.files", "dspark.quantize", "dspark.packed", "dspark.loading", "dspark.target",
                "dspark.ragged", "dspark.compiled", "dspark.batch_decode", "dspark.text", "dspark.cli_args")),
    ("drafters", ("dspark.drafters",)),
    ("runtime", ("dspark.scheduler", "dspark.gate", "dspark.profiling", "dspark.engine", "dspark.generation",
                 "dspark.factory")),
    ("api", ("dspark.api", "dspark")),
    ("eval", ("dspark.eval", "dspark.plots")),
    ("calibration", ("dspark.calibration",)),
    ("train", ("dspark.train",)),
    ("bench", ("dspark.peers", "dspark.bench", "dspark.bench_load", "dspark.bench_forward")),
    ("report", ("dspark.report", "dspark.cli_eval")),
    ("server", ("dspark.server",)),
    ("cli", ("dspark.cli",)),
]

#: (importer, imported, name) private imports tolerated for now; each must still occur, so an entry goes
#: once its import does. Empty: keep it that way.
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(path): ast.parse(path.read_text(), str(path))
            for path in sorted((ROOT / "dspark").rglob("*.py"))}


def layer_of(name: str) -> int | None:
    best, depth = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            inside = name == prefix or (prefix != "dspark" and name.startswith(prefix + "."))
            if inside and prefix.count(".") > depth:
                best, depth = index, prefix.count(".")
    return best


def imports(tree: ast.Module, importer: str, known: set[str]) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every dspark import in the tree; `from
    package import submodule` counts as importing the submodule."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, importer)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.append((child, None, node.lineno) if child in known else (base, alias.name, node.lineno))
    return [(module, name, line) for module, name, line in found if module.split(".")[0] == "dspark"]


def _absolute(node: ast.ImportFrom, importer: str) -> str:
    if not node.level:
        return node.module or ""
    is_package = (ROOT / Path(*importer.split(".")) / "__init__.py").is_file()
    parts = importer.split(".")[: len(importer.split(".")) - node.level + is_package]
    return ".".join(parts + ([node.module] if node.module else []))


def private_attribute_uses(tree: ast.Module, known: set[str]) -> list[tuple[str, str, int]]:
    """`module._name` where `module` was bound by importing a dspark module."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in known:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            bound.update({alias.asname: alias.name for alias in node.names if alias.asname and alias.name in known})
    return [(bound[node.value.id], node.attr, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
            and _private(node.attr)]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_every_module_has_a_layer():
    assert [name for name in modules() if layer_of(name) is None] == []


def test_imports_point_down():
    trees = modules()
    known = set(trees)
    upward = []
    for importer, tree in trees.items():
        for module, _, line in imports(tree, importer, known):
            target = layer_of(module)
            if target is not None and target > layer_of(importer):
                upward.append(f"{importer}:{line} ({LAYERS[layer_of(importer)][0]}) imports {module} "
                              f"({LAYERS[target][0]})")
    assert upward == []


def test_no_module_imports_another_modules_private_names():
    trees = modules()
    known = set(trees)
    found = set()
    for importer, tree in trees.items():
        for module, name, line in imports(tree, importer, known):
            if name is not None and _private(name) and module != importer:
                found.add((importer, module, name, line))
        for module, name, line in private_attribute_uses(tree, known):
            if module != importer:
                found.add((importer, module, name, line))
    unexpected = sorted(f for f in found if f[:3] not in KNOWN_PRIVATE_IMPORTS)
    assert unexpected == []
    assert KNOWN_PRIVATE_IMPORTS <= {f[:3] for f in found}, "a known private import is gone: drop its entry"


def test_layers_are_a_strict_order_of_disjoint_prefixes():
    prefixes = [prefix for _, group in LAYERS for prefix in group]
    assert len(prefixes) == len(set(prefixes))
    assert len({name for name, _ in LAYERS}) == len(LAYERS)
