"""The package's shape, read from its source with ``ast`` (nothing is imported): no import
cycle between its modules — lazy imports inside functions included, since they only defer
the cycle to a call — and no module too long to read as one job."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "longtrain"
MAX_LINES = 600
ROOT = SOURCE / PACKAGE


def _modules() -> dict[str, Path]:
    """Dotted module name -> file; a package is its ``__init__.py``."""
    found = {}
    for path in sorted((SOURCE / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SOURCE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source, inside functions
    too (a ``from P import x`` names submodule ``P.x`` where that exists, else the package
    ``P``); imports under ``if TYPE_CHECKING:`` are for type checkers only and left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()

    def known(dotted: str) -> str:
        """The longest prefix of ``dotted`` that is one of the package's modules."""
        while dotted not in modules:
            dotted = dotted.rpartition(".")[0]
            assert dotted, f"{path}: imports a module of {PACKAGE} that does not exist"
        return dotted

    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets.update(known(alias.name) for alias in node.names
                           if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            elif node.module == PACKAGE or (node.module or "").startswith(PACKAGE + "."):
                base = node.module
            else:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else known(base))
    targets.discard(name)
    return targets


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of modules (Tarjan), as a path
    that returns to its start."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)

    def cycle(group: set[str]) -> list[str]:  # a shortest way back to the group's first module
        start = min(group)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            for w in sorted(graph[path[-1]] & group):
                if w == start:
                    return path + [start]
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
        raise AssertionError("a strongly connected group without a cycle")

    return sorted(cycle(group) for group in groups)


def import_cycles() -> list[list[str]]:
    modules = _modules()
    return _cycles({name: _imports(name, path, modules) for name, path in modules.items()})


def test_no_import_cycle():
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_module_over_600_lines():
    long = {str(path.relative_to(SOURCE)): n for path in _modules().values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_plan_names_no_engine_or_technique():
    """plan/ asks the registry's costs; a name of a built-in engine or technique in quotes
    there would be a switch a new engine must edit."""
    quoted = re.compile(r"""['"](fpdt|seco|spaco|memo|adjoint|checkpoint|mst|liger)['"]""")
    found = [f"{path.name}:{n}" for path in sorted((ROOT / "plan").glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if quoted.search(line)]
    assert not found, found


def test_docs_and_code_speak_of_the_project_only():
    """No words about how the work was organised and no paths outside the repository."""
    work = re.compile(r"\b(sessions?|leases?|issues? [0-9]+)\b", re.IGNORECASE)
    outside = re.compile(r"/work/|\.\./shared")
    repo = ROOT.parents[1]
    files = [repo / "README.md", *sorted((repo / "docs").rglob("*.md")), *sorted((repo / "docs").rglob("*.json")),
             *sorted(ROOT.rglob("*.py"))]
    found = [f"{path.relative_to(repo)}:{n}" for path in files
             for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
             if work.search(line) or outside.search(line)]
    assert not found, found


def test_options_classes_share_one_naming_scheme():
    """Every options class is <Name>Options."""
    import longtrain as lt

    assert all(name.endswith("Options") for name in lt.__all__ if name[0].isupper() and name not in
               ("LongtrainError", "Strategy"))


def test_the_lowest_floors_import_nothing_above_them():
    """ops/ and memory/ (tensor ops, the tracker, stores) use nothing of longtrain but its
    errors and thread flag, so every floor above may use them."""
    modules = _modules()
    allowed = {PACKAGE, f"{PACKAGE}.errors", f"{PACKAGE}.thread_flag"}
    for floor in ("ops", "memory"):
        prefix = f"{PACKAGE}.{floor}"
        for name, path in modules.items():
            if name == prefix or name.startswith(prefix + "."):
                above = {t for t in _imports(name, path, modules)
                         if t not in allowed and not t.startswith(prefix)}
                assert not above, (name, above)


METHOD_KINDS = {"engines": "schedule", "techniques": "install"}
METHOD_ORDER = ("options", "costs")  # below the run module, in this order


def _method_packages() -> list[tuple[str, str]]:
    """(kind, name) of every engine and technique package (shared machinery excluded)."""
    found = []
    for kind in METHOD_KINDS:
        for init in sorted((ROOT / kind).glob("*/__init__.py")):
            if (init.parent / "options.py").exists():
                found.append((kind, init.parent.name))
    return found


def test_each_engine_and_technique_is_a_package_of_options_run_and_costs():
    """Every registered engine and technique is a folder with options.py, a run module
    (schedule.py or install.py), costs.py and an __init__ that registers its spec."""
    import longtrain.strategy  # noqa: F401  (registers everything)
    from longtrain import registry

    packages = _method_packages()
    names = {name for _, name in packages}
    assert set(registry.engines()) <= names and set(registry.techniques()) <= names, names
    for kind, name in packages:
        folder = ROOT / kind / name
        missing = [f for f in ("options.py", f"{METHOD_KINDS[kind]}.py", "costs.py") if not (folder / f).exists()]
        assert not missing, (folder, missing)
        assert "register(" in (folder / "__init__.py").read_text(), folder


def test_imports_inside_a_method_package_run_init_then_run_then_costs_then_options():
    """``__init__ → schedule/install → costs → options``: options imports nothing of its
    package, costs only its options, and nothing imports a package's own ``__init__``;
    further modules of a run (memo's layers.py) sit between the run module and costs."""
    modules = _modules()
    for kind, name in _method_packages():
        package = f"{PACKAGE}.{kind}.{name}"
        rank = {f"{package}.options": 0, f"{package}.costs": 1, f"{package}.{METHOD_KINDS[kind]}": 2, package: 3}
        for module, path in modules.items():
            if module != package and not module.startswith(package + "."):
                continue
            own = {t for t in _imports(module, path, modules) if t == package or t.startswith(package + ".")}
            mine = rank.get(module, 1.5)  # further modules of the run sit below it, above costs
            above = sorted(t for t in own if rank.get(t, 1.5) >= mine and t != module)
            assert not above, f"{module} imports {above} (imports run __init__ → {METHOD_KINDS[kind]} → costs → options)"


def test_no_shared_engine_module_switches_on_an_engine_name():
    """The engines' shared modules (base, batch, the chunked machinery, ...) never compare
    against an engine's name: what differs is a setting or a cost the engine passes."""
    quoted = re.compile(r"""['"](backprop|fpdt|seco|spaco|adjoint)['"]""")
    engine_packages = {name for kind, name in _method_packages() if kind == "engines"}
    shared = [path for path in sorted((ROOT / "engines").rglob("*.py"))
              if path.relative_to(ROOT / "engines").parts[0] not in engine_packages]
    found = [f"{path.relative_to(ROOT)}:{n}" for path in shared
             for n, line in enumerate(path.read_text().splitlines(), 1) if quoted.search(line)]
    assert not found, found


def test_plan_reads_no_option_field_by_name():
    """plan/ asks an engine's or a technique's costs about its options; it never reads
    their fields (a getattr, or an attribute of ``engine_options``)."""
    by_name = re.compile(r"getattr\((\w*options|strategy\.\w+)\b|engine_options\.[a-z_]+")
    found = [f"{path.name}:{n}: {line.strip()}" for path in sorted((ROOT / "plan").glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if by_name.search(line)]
    assert not found, found
