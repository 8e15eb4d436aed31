"""The tree passes its own lint and type checks (configured in pyproject.toml), run with the
interpreter that runs the tests; skipped where ruff, mypy or vulture is not installed (the `test`
extra brings them)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run_tool(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed in this interpreter (pip install '.[test]')")
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _assert_clean(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, (
        f"{' '.join(result.args[2:])} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    )


@pytest.mark.slow
@pytest.mark.timeout(600)  # the tool's own limit is 300 s
def test_ruff_finds_nothing_in_agent_tests_and_bench():
    _assert_clean(_run_tool("ruff", "check", "--no-cache", "--output-format=concise", "agent", "tests", "bench"))


@pytest.mark.slow
@pytest.mark.timeout(600)  # the tool's own limit is 300 s
def test_mypy_finds_no_type_errors_in_agent():
    _assert_clean(_run_tool("mypy"))


@pytest.mark.slow
@pytest.mark.timeout(600)  # the tool's own limit is 300 s
def test_vulture_finds_no_dead_code_in_agent():
    # configured in pyproject.toml ([tool.vulture]): agent/ is the only user of its names
    # (tests/ and bench/ are not read), plus tests/vulture_whitelist.py
    result = _run_tool("vulture")
    findings = [line for line in result.stdout.splitlines() if line.startswith("agent/")]
    assert result.returncode in (0, 3) and not result.stderr, result.stderr  # 3: it found something
    assert not findings, "unused code (delete it, or name its user in tests/vulture_whitelist.py):\n" + "\n".join(findings)


#: Module-level functions and classes of agent/ that no module of agent/ names, and who uses
#: them ("module:name", shell-style patterns).
MODULE_LEVEL_USERS = {
    "agent.commands.*:add_parser": "agent/cli.py calls it on every module of COMMAND_MODULES",
}


def _module_level_uses(trees: dict[str, tuple[Path, ast.Module]]) -> set[tuple[str, str]]:
    """(module, name) pairs that some module of ``trees`` uses: a name read in its own module,
    ``from module import name`` (relative too), or ``alias.name`` where ``alias`` is the
    module imported (``import a.b as alias``, ``from a import b``, dotted chains)."""
    used: set[tuple[str, str]] = set()
    for mod, (path, tree) in trees.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    if f"{base}.{a.name}" in trees:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
                    used.add((base, a.name))
            elif isinstance(node, ast.Import):
                for a in node.names:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
                used.add((mod, node.id))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                chain, value = [node.attr], node.value
                while isinstance(value, ast.Attribute):
                    chain.append(value.attr)
                    value = value.value
                if isinstance(value, ast.Name) and value.id in aliases:
                    dotted = [aliases[value.id], *reversed(chain)]
                    used.update((".".join(dotted[:i]), dotted[i]) for i in range(1, len(dotted)))
    return used


def test_the_module_level_use_check_tells_a_used_definition_from_one_that_only_shares_its_name():
    # the check's point: a same-named attribute elsewhere (``other.use``) is not a use
    sources = {
        "pkg.a": ("pkg/a.py", "def used(): pass\ndef use(): pass\ndef helper(): pass\nhelper()\n"),
        "pkg.b": ("pkg/b.py", "from pkg.a import used\nimport pkg.a as a\nused(); something.use()\n"),
    }
    trees = {mod: (Path(path), ast.parse(src)) for mod, (path, src) in sources.items()}
    uses = _module_level_uses(trees)
    assert ("pkg.a", "used") in uses and ("pkg.a", "helper") in uses
    assert ("pkg.a", "use") not in uses


def test_every_module_level_function_and_class_of_the_agent_is_used_by_the_agent():
    # vulture matches names, not modules: a function is "used" when any attribute anywhere
    # has its name (a test-only kernel.use went unseen because other objects have a .use).
    # This check asks for the module too, for module-level functions and classes (methods
    # need types, which it does not have: vulture alone covers them)
    from fnmatch import fnmatch

    trees = {_module_name(ROOT, p): (p, ast.parse(p.read_text(encoding="utf-8"))) for p in _agent_modules()}
    defined = {
        (mod, node.name)
        for mod, (_, tree) in trees.items()
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    assert len(defined) > 100  # the walk found the agent's definitions
    unused = sorted(
        f"{mod}:{name}" for mod, name in defined - _module_level_uses(trees)
        if not any(fnmatch(f"{mod}:{name}", pattern) for pattern in MODULE_LEVEL_USERS)
    )
    assert not unused, (
        "defined at module level and used by no module of agent/ (delete it, or name its user"
        " in MODULE_LEVEL_USERS):\n" + "\n".join(unused)
    )


#: Issue 16: no module of the agent above 500 lines (the generated gRPC stubs in agent/_proto
#: and the Cython kernel ext/_topo.pyx aside), and one above 400 says why in its module
#: docstring: a paragraph that starts with "Size:". No function above 60 lines.
MAX_MODULE_LINES = 500
REASON_ABOVE_LINES = 400
MAX_FUNCTION_LINES = 60


def _size_reason(tree: ast.Module) -> str | None:
    """The module docstring's paragraph that starts with ``Size:`` (None: there is none)."""
    doc = ast.get_docstring(tree) or ""
    for paragraph in doc.split("\n\n"):
        text = " ".join(paragraph.split())
        if text.startswith("Size:") and len(text) > len("Size:"):
            return text
    return None


def _oversized(path: Path, text: str) -> list[str]:
    """What in one module breaks the size limits: the module itself (above the cap, or above
    400 lines without a "Size:" reason), and each function (nested ones and methods
    included) measured from its ``def`` to its last line."""
    found = []
    tree = ast.parse(text)
    lines = len(text.splitlines())
    if lines > MAX_MODULE_LINES:
        found.append(f"{path}: {lines} lines (at most {MAX_MODULE_LINES})")
    elif lines > REASON_ABOVE_LINES and _size_reason(tree) is None:
        found.append(
            f"{path}: {lines} lines without a reason (above {REASON_ABOVE_LINES}, its module "
            'docstring needs a paragraph starting "Size:" that says why it stays one module)'
        )
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path}:{node.lineno} {node.name}: {length} lines (at most {MAX_FUNCTION_LINES})")
    return found


def _agent_modules() -> list[Path]:
    """The agent's own modules (the generated gRPC stubs of agent/_proto aside)."""
    modules = [p for p in sorted((ROOT / "agent").rglob("*.py")) if "_proto" not in p.relative_to(ROOT).parts]
    assert len(modules) > 20  # the walk found the agent's modules
    return modules


def test_no_module_above_500_lines_none_above_400_without_a_reason_and_no_function_above_60():
    found = [f for p in _agent_modules() for f in _oversized(p.relative_to(ROOT), p.read_text(encoding="utf-8"))]
    assert found == [], (
        "split these by job (trimming docstrings, comments or blank lines to fit is not a fix:"
        " the limit is about jobs, not lines):\n" + "\n".join(found)
    )


def test_the_size_check_reports_a_long_module_a_missing_reason_and_a_long_nested_function():
    long_function = "def outer():\n    def inner():\n" + "        x = 1\n" * 60 + "    return inner\n"
    assert _oversized(Path("f.py"), long_function) == [
        "f.py:1 outer: 63 lines (at most 60)", "f.py:2 inner: 61 lines (at most 60)",
    ]
    assert _oversized(Path("m.py"), "x = 1\n" * 501) == ["m.py: 501 lines (at most 500)"]
    reasoned = '"""One job.\n\nSize: the schema reads as one table.\n"""\n'
    assert _oversized(Path("r.py"), reasoned + "x = 1\n" * 496) == []  # 500 with a reason
    assert _oversized(Path("r.py"), reasoned + "x = 1\n" * 497) == ["r.py: 501 lines (at most 500)"]
    unreasoned = '"""One job.\n\nSize is not a reason unless the paragraph starts with it.\n"""\n'
    assert _oversized(Path("u.py"), unreasoned + "x = 1\n" * 397) == [
        'u.py: 401 lines without a reason (above 400, its module docstring needs a paragraph '
        'starting "Size:" that says why it stays one module)'
    ]
    assert _oversized(Path("u.py"), unreasoned + "x = 1\n" * 396) == []  # 400: no reason needed
    assert _oversized(Path("ok.py"), "x = 1\n" * 340 + "def f():\n" + "    pass\n" * 59) == []


# ---------------------------------------------------------------------- import cycles
def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported_modules(
    root: Path, name: str, is_package: bool, tree: ast.Module, known: set[str]
) -> list[tuple[str, int]]:
    """Every module of ``known`` that ``tree`` imports, with the line: every import statement
    anywhere in the module (inside functions, ``if TYPE_CHECKING:`` blocks and ``try``
    included). ``from P import x`` is an import of ``P.x`` where that is a module, else of
    ``P``. The implicit import of a module's parent packages is not counted."""
    package = name if is_package else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name in known]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in known:
                    found.append((target, node.lineno))
                elif base in known:
                    found.append((base, node.lineno))
    return [(target, line) for target, line in found if target != name]


def _import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """module -> {module it imports: first line importing it}, over the ``.py`` files of
    ``root/package`` (its ``_proto`` stubs, generated at build time, aside)."""
    paths = {
        _module_name(root, p): p
        for p in sorted((root / package).rglob("*.py"))
        if "_proto" not in p.relative_to(root).parts
    }
    known = set(paths)
    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges: dict[str, int] = {}
        for target, line in _imported_modules(root, name, path.name == "__init__.py", tree, known):
            edges.setdefault(target, line)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def _describe_cycles(root: Path, graph: dict[str, dict[str, int]]) -> list[str]:
    """One line per import edge inside each cycle: where the import statement is."""
    out = []
    for component in _cycles(graph):
        members = set(component)
        out.append("cycle: " + " <-> ".join(component))
        for a in component:
            for b, line in sorted(graph[a].items()):
                if b in members:
                    path = root / (a.replace(".", "/") + ".py")
                    if not path.exists():
                        path = root / a.replace(".", "/") / "__init__.py"
                    out.append(f"  {path.relative_to(root)}:{line} imports {b}")
    return out


def test_no_two_modules_of_the_agent_import_each_other_directly_or_in_a_loop():
    """DESIGN.md: no two modules import each other, directly or in a loop, function-level
    imports included. Every import statement counts, wherever it is (import-linter's
    contracts check the direction between layers, not loops inside one)."""
    graph = _import_graph(ROOT, "agent")
    assert len(graph) > 20 and sum(map(len, graph.values())) > 50  # the walk found the imports
    found = _describe_cycles(ROOT, graph)
    assert found == [], "modules that import each other:\n" + "\n".join(found)


def test_the_cycle_check_sees_function_level_type_checking_relative_and_long_loops(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        # a <-> b: b imports a inside a function only
        "a.py": "import pkg.b\n",
        "b.py": "def f():\n    from pkg import a\n    return a\n",
        # c -> d -> e -> c: the last edge only under TYPE_CHECKING, the middle one relative
        "c.py": "from pkg.d import x\n",
        "d.py": "from .e import y\nx = 1\n",
        "e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\ny = 2\n",
        # no loop: f imports g, g imports a name of the package
        "f.py": "from pkg import g\n",
        "g.py": "from pkg import sub\nimport json\n",
        "sub/__init__.py": "from ..f import *\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = _import_graph(tmp_path, "pkg")
    assert _cycles(graph) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d", "pkg.e"], ["pkg.f", "pkg.g", "pkg.sub"]]
    assert _describe_cycles(tmp_path, graph)[:3] == [
        "cycle: pkg.a <-> pkg.b", "  pkg/a.py:1 imports pkg.b", "  pkg/b.py:2 imports pkg.a",
    ]
    (pkg / "sub/__init__.py").write_text("")
    assert ["pkg.f", "pkg.g", "pkg.sub"] not in _cycles(_import_graph(tmp_path, "pkg"))
