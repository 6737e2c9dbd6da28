"""Import direction and cycles, by static analysis of every import statement in the package
(lazy imports inside functions included)."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "kvcodec"
FORBIDDEN_FOR_VIDEO = ("kvcodec.codec", "kvcodec.codecs", "kvcodec.fetcher", "kvcodec.engine", "kvcodec.restore")


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str | None = None) -> set[str]:
    """Absolute names of the kvcodec modules `path` (module `name`) imports, anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = (name or module_name(path)).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {name for name in found if name == "kvcodec" or name.startswith("kvcodec.")}


def modules() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PKG.rglob("*.py"))}


def subpackage(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def test_finds_lazy_and_relative_imports(tmp_path):
    f = PKG / "video" / "__init__.py"
    assert module_name(f) == "kvcodec.video"
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f():\n    from kvcodec import codec\n    import kvcodec.fetcher.keys\n    from ..fetcher import cache\n"
    )
    assert {"kvcodec.codec", "kvcodec.fetcher.keys", "kvcodec.fetcher.cache"} <= imports_of(probe, "kvcodec.video.x")


def test_video_imports_nothing_above_it():
    bad = {
        mod: sorted(i for i in imps if any(i == f or i.startswith(f + ".") for f in FORBIDDEN_FOR_VIDEO))
        for mod, imps in modules().items()
        if mod.startswith("kvcodec.video")
    }
    bad = {m: i for m, i in bad.items() if i}
    assert not bad, f"video backends import codec/fetcher/engine/restore modules: {bad}"


def subpackage_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod, imps in modules().items():
        src = subpackage(mod)
        if src is None:
            continue
        for imp in imps:
            dst = subpackage(imp)
            if dst and dst != src:
                graph.setdefault(src, set()).add(dst)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Pairs of subpackages that reach each other."""

    def reach(a: str) -> set[str]:
        seen, todo = set(), [a]
        while todo:
            for b in graph.get(todo.pop(), ()):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen

    r = {a: reach(a) for a in graph}
    return sorted(
        {frozenset({a, b}) for a, b in itertools.combinations(sorted(graph), 2) if b in r[a] and a in r.get(b, set())},
        key=sorted,
    )


def test_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [
        frozenset({"a", "b"}),
        frozenset({"a", "c"}),
        frozenset({"b", "c"}),
    ]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_subpackages():
    found = cycles(subpackage_graph())
    assert not found, f"import cycles between kvcodec subpackages: {[sorted(c) for c in found]}"


# docs/ARCHITECTURE.md's layering table: each top-level module or subpackage, its layer, and what it may
# import (lazy imports inside functions included). Edges go to lower layers only.
LAYERS: dict[str, tuple[int, frozenset[str]]] = {
    "errors": (0, frozenset()),
    "dtypes": (1, frozenset({"errors"})),
    "config": (1, frozenset({"errors"})),
    "plugins": (1, frozenset({"errors"})),
    "atomic": (1, frozenset({"errors"})),
    "native": (1, frozenset({"errors"})),
    "quant": (2, frozenset({"errors"})),
    "kvspec": (2, frozenset({"atomic", "dtypes", "errors"})),
    "container": (2, frozenset({"config", "dtypes", "errors"})),
    "store": (2, frozenset({"atomic", "plugins", "errors"})),
    "video": (2, frozenset({"native", "plugins", "errors"})),
    "layout": (3, frozenset({"atomic", "quant", "errors"})),
    "transform": (3, frozenset({"atomic", "kvspec", "quant", "errors"})),
    "models": (4, frozenset({"atomic", "kvspec", "transform", "errors"})),
    "restore": (4, frozenset({"layout", "quant", "transform", "errors"})),
    "codecs": (
        5,
        frozenset(
            {"config", "container", "dtypes", "errors", "kvspec", "layout", "native", "plugins", "quant", "restore"}
            | {"transform", "video"}
        ),
    ),
    "codec": (6, frozenset({"codecs", "dtypes"})),
    "fetcher": (
        6,
        frozenset({"atomic", "codecs", "config", "dtypes", "errors", "kvspec", "restore", "store", "video"}),
    ),
    "integrations": (
        7,
        frozenset({"codecs", "config", "errors", "fetcher", "kvspec", "models", "restore", "store"}),
    ),
    "engine": (
        8,
        frozenset({"codecs", "config", "errors", "fetcher", "integrations", "kvspec", "layout", "models", "store"}),
    ),
    "server": (9, frozenset({"engine", "errors"})),
    "ingest": (
        9,
        frozenset({"codecs", "engine", "errors", "fetcher", "integrations", "layout", "models", "store"}),
    ),
}


def test_the_layering_table_points_down():
    up = {(a, b) for a, (layer, deps) in LAYERS.items() for b in deps if LAYERS[b][0] >= layer}
    assert not up, f"the layering table lets a module import one at its own layer or above: {sorted(up)}"


def test_subpackages_import_only_what_the_layering_table_allows():
    graph = subpackage_graph()
    unknown = sorted(set(graph) - set(LAYERS) - {"cli"})
    assert not unknown, f"modules missing from the layering table (docs/ARCHITECTURE.md): {unknown}"
    extra = {a: sorted(b - LAYERS[a][1]) for a, b in graph.items() if a in LAYERS and b - LAYERS[a][1]}
    assert not extra, f"imports the layering table (docs/ARCHITECTURE.md) does not allow: {extra}"


def test_every_name_a_public_package_exports_resolves():
    """`from kvcodec.codecs import TransformCodec` (the docs' import) failed: a lazily exported name
    missing from its module's table is an ImportError only a user finds."""
    import importlib

    for package in ("kvcodec", "kvcodec.codecs", "kvcodec.fetcher", "kvcodec.store", "kvcodec.engine"):
        module = importlib.import_module(package)
        for name in module.__all__:
            assert getattr(module, name) is not None, f"{package}.{name}"
    from kvcodec.codecs import GroupedCodec, TransformAnsCodec, TransformCodec

    assert issubclass(TransformAnsCodec, TransformCodec) and GroupedCodec.__name__ == "GroupedCodec"
