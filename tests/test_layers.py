"""Layers import one way: core <- solvers <- plan <- runtime <- cli (README, "Where things are").

Every module of the five code folders is read with ``ast``: its module-level imports and the
ones inside functions, absolute and relative. The checks, each with a test that feeds it a
broken module so that it is seen to fail:

- no import of a higher layer, at module level or in a function;
- no cycle among module-level imports;
- an import inside a function is there for start-up time only: it says why in a comment (on its
  line or just above), and what it defers loads torch, OR-Tools, PuLP or highspy;
- torch is loaded only by the runtime: no module elsewhere reaches it through module-level imports;
- commands do not import each other: what two commands share lives in a module of its own;
- no module over 500 lines and no function over 60, so each can be read in one sitting.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"core": 0, "solvers": 1, "plan": 2, "runtime": 3, "cli": 4}
HEAVY = {"torch", "ortools", "pulp", "highspy"}  # what a function-level import may defer


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, e.g. optpipe.solvers.compile
    target: str  # the imported module, absolute: optpipe.core.problem, torch.nn, ...
    where: str  # file:line
    lazy: bool  # inside a function
    commented: bool  # a comment on its line or on the line just above its block of imports


def code_modules(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """optpipe module name -> (source text, is a package), for every module of the five layers."""
    modules = {}
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            package = parts[-1] == "__init__"
            if package:
                parts.pop()
            modules[".".join(["optpipe", *parts])] = (path.read_text(), package)
    return modules


def _comment_lines(text: str) -> set[int]:
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return {token.start[0] for token in tokens if token.type == tokenize.COMMENT}


def _resolve(node: ast.ImportFrom, name: str, package: str, known: set[str]) -> str:
    """The module ``from <node.module> import <name>`` loads: a submodule when ``name`` is one."""
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module
    return f"{module}.{name}" if f"{module}.{name}" in known else module


def imports_of(name: str, text: str, is_package: bool, known: set[str]) -> list[Import]:
    """Every import statement of one module, with where it is and whether it sits in a function."""
    tree = ast.parse(text)
    comments = _comment_lines(text)
    lines = text.splitlines()
    package = name if is_package else name.rsplit(".", 1)[0]
    found: list[Import] = []

    def commented(node: ast.stmt) -> bool:
        if comments & set(range(node.lineno, node.end_lineno + 1)):
            return True
        above = node.lineno - 1
        while above >= 1 and lines[above - 1].strip().startswith(("import ", "from ")):
            above -= 1  # the block of imports this one belongs to
        return above in comments and lines[above - 1].strip().startswith("#")

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                targets = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                targets = [_resolve(child, alias.name, package, known) for alias in child.names]
            else:
                visit(child, inner)
                continue
            if targets == ["__future__"]:
                continue
            for target in dict.fromkeys(targets):
                found.append(Import(name, target, f"{name}:{child.lineno}", lazy, commented(child)))

    visit(tree, False)
    return found


def all_imports(modules: dict[str, tuple[str, bool]]) -> list[Import]:
    known = set(modules)
    return [imp for name, (text, package) in modules.items() for imp in imports_of(name, text, package, known)]


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if parts[0] == "optpipe" and len(parts) > 1 else None


# --------------------------------------------------------------------------- the checks


def upward_edges(imports: list[Import]) -> list[str]:
    """Imports of a higher layer, as ``source -> target (file:line)``."""
    bad = []
    for imp in imports:
        source, target = layer_of(imp.source), layer_of(imp.target)
        if target is not None and source is not None and target > source:
            kind = "in a function" if imp.lazy else "at module level"
            bad.append(f"{imp.source} -> {imp.target} ({imp.where}, {kind})")
    return bad


def _graph(imports: list[Import], known: set[str]) -> dict[str, list[str]]:
    graph: dict[str, list[str]] = {module: [] for module in known}
    for imp in imports:
        if not imp.lazy:
            graph[imp.source].append(imp.target)
    return graph


def module_cycles(imports: list[Import], known: set[str]) -> list[str]:
    """Cycles among module-level imports of optpipe modules, as ``a -> b -> a``."""
    graph = {m: [t for t in targets if t in known] for m, targets in _graph(imports, known).items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in graph[module]:
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return cycles


def loads(imports: list[Import], known: set[str]) -> dict[str, set[str]]:
    """Module -> the third-party top-level packages its module-level imports load, directly or not."""
    graph = _graph(imports, known)
    memo: dict[str, set[str]] = {}

    def reach(module: str, seen: set[str]) -> set[str]:
        if module in memo:
            return memo[module]
        out: set[str] = set()
        for target in graph.get(module, ()):
            if target in known:
                if target not in seen:
                    out |= reach(target, seen | {target})
            elif not target.startswith("optpipe.") and target.split(".")[0] not in sys.stdlib_module_names:
                out.add(target.split(".")[0])
        memo[module] = out
        return out

    return {module: reach(module, {module}) for module in known}


def unjustified_lazy_imports(imports: list[Import], known: set[str]) -> list[str]:
    """Function-level imports of optpipe or third-party modules with no reason, or that defer nothing heavy."""
    loaded = loads(imports, known)
    bad = []
    for imp in imports:
        top = imp.target.split(".")[0]
        if not imp.lazy or (top != "optpipe" and top in sys.stdlib_module_names):
            continue
        defers = loaded.get(imp.target, set()) if imp.target in known else {top}
        if not imp.commented:
            bad.append(f"{imp.where}: {imp.target} is imported in a function without a comment saying why")
        elif not defers & HEAVY:
            bad.append(f"{imp.where}: {imp.target} is imported in a function but loads none of "
                       f"{', '.join(sorted(HEAVY))}; import it at module level")
    return bad


def torch_outside_runtime(imports: list[Import], known: set[str]) -> list[str]:
    """Modules outside runtime/ that load torch: directly, or through their module-level imports."""
    loaded = loads(imports, known)
    bad = [f"{m} loads torch at import time" for m in sorted(known)
           if layer_of(m) != LAYERS["runtime"] and "torch" in loaded[m]]
    for imp in imports:
        if imp.target.split(".")[0] == "torch" and layer_of(imp.source) != LAYERS["runtime"]:
            if not (layer_of(imp.source) == LAYERS["cli"] and imp.lazy and imp.commented):
                bad.append(f"{imp.where}: imports torch outside the runtime")
    return bad


def command_to_command(imports: list[Import]) -> list[str]:
    """Imports of one ``cli/commands/*_cmd`` module by another."""
    def command(module: str) -> bool:
        return module.startswith("optpipe.cli.commands.") and module.endswith("_cmd")

    return [f"{imp.source} -> {imp.target} ({imp.where})" for imp in imports
            if command(imp.source) and command(imp.target)]


# --------------------------------------------------------------------------- the tree


MODULES = code_modules()
KNOWN = set(MODULES)
IMPORTS = all_imports(MODULES)


def test_the_walk_sees_every_layer_and_both_kinds_of_import():
    assert {layer_of(m) for m in KNOWN} == set(LAYERS.values())
    assert any(i.lazy for i in IMPORTS) and any(not i.lazy for i in IMPORTS)
    assert Import("optpipe.core.costmodel", "optpipe.core.tables", "optpipe.core.costmodel:30", False,
                  False) in IMPORTS


def test_no_layer_imports_a_higher_one():
    assert upward_edges(IMPORTS) == []


def test_no_module_level_import_cycle():
    assert module_cycles(IMPORTS, KNOWN) == []


def test_function_level_imports_are_for_start_up_time_and_say_so():
    assert unjustified_lazy_imports(IMPORTS, KNOWN) == []


def test_only_the_runtime_loads_torch():
    assert torch_outside_runtime(IMPORTS, KNOWN) == []
    assert "torch" in loads(IMPORTS, KNOWN)["optpipe.runtime.train"]  # the closure does reach torch


def test_commands_do_not_import_each_other():
    assert command_to_command(IMPORTS) == []


# --------------------------------------------------------------------------- the checks can fail


def _fake(**sources: str) -> tuple[list[Import], set[str]]:
    """Imports of made-up modules, named like ``core__a`` for optpipe.core.a."""
    modules = {"optpipe." + name.replace("__", "."): (text, False) for name, text in sources.items()}
    return all_imports(modules), set(modules)


def test_an_upward_edge_is_named_at_module_level_and_in_a_function():
    imports, _ = _fake(core__a="from optpipe.solvers.b import x\n",
                       solvers__b="def f():\n    from ..plan.c import y  # c is slow\n",
                       plan__c="from optpipe.core.a import z\n")
    assert upward_edges(imports) == [
        "optpipe.core.a -> optpipe.solvers.b (optpipe.core.a:1, at module level)",
        "optpipe.solvers.b -> optpipe.plan.c (optpipe.solvers.b:2, in a function)",
    ]


def test_a_cycle_is_named_and_a_lazy_edge_breaks_none():
    imports, known = _fake(core__a="from . import b\n", core__b="from optpipe.core.c import x\n",
                           core__c="import optpipe.core.a\n")
    assert module_cycles(imports, known) == ["optpipe.core.a -> optpipe.core.b -> optpipe.core.c -> optpipe.core.a"]
    imports, known = _fake(core__a="from . import b\n", core__b="def f():\n    from .a import x  # why\n")
    assert module_cycles(imports, known) == []


def test_a_lazy_import_needs_a_reason_and_something_heavy_to_defer():
    imports, known = _fake(
        solvers__heavy="from ortools.sat.python import cp_model\n",
        solvers__light="import json\n",
        solvers__user=("def f():\n    from .heavy import x\n"  # no comment
                       "def g():\n    # lazy: loads OR-Tools\n    from .heavy import x\n    import pulp\n"
                       "def h():\n    from .light import y  # lazy for no reason\n"
                       "def i():\n    import rich  # loads slowly\n"
                       "def j():\n    import json\n"))
    assert unjustified_lazy_imports(imports, known) == [
        "optpipe.solvers.user:2: optpipe.solvers.heavy is imported in a function without a comment saying why",
        "optpipe.solvers.user:8: optpipe.solvers.light is imported in a function but loads none of highspy, "
        "ortools, pulp, torch; import it at module level",
        "optpipe.solvers.user:10: rich is imported in a function but loads none of highspy, ortools, pulp, torch; "
        "import it at module level",
    ]


def test_torch_outside_the_runtime_is_found_directly_and_through_imports():
    imports, known = _fake(runtime__rt="import torch\n", plan__p="def f():\n    import torch  # why\n",
                           cli__ok="def f():\n    # torch loads when the command runs\n    import torch\n",
                           cli__eager="from optpipe.runtime.rt import x\n")
    assert torch_outside_runtime(imports, known) == [
        "optpipe.cli.eager loads torch at import time",
        "optpipe.plan.p:2: imports torch outside the runtime",
    ]


def test_a_command_importing_another_is_named():
    imports, _ = _fake(cli__commands__demo_cmd="def run():\n    from .compile_cmd import compile_live  # why\n",
                       cli__commands__compile_cmd="from optpipe.cli.views import print_result\n")
    assert command_to_command(imports) == [
        "optpipe.cli.commands.demo_cmd -> optpipe.cli.commands.compile_cmd (optpipe.cli.commands.demo_cmd:2)"]


# ------------------------------------------------------------------- sizes a reader can hold

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def oversized(modules: dict[str, tuple[str, bool]]) -> list[str]:
    """Modules over MAX_FILE_LINES lines and functions over MAX_FUNCTION_LINES, by name."""
    found = []
    for name, (text, _) in sorted(modules.items()):
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            found.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{name}.{node.name}: {length} lines")
    return found


def test_no_file_or_function_too_long_to_read_in_one_sitting():
    assert oversized(MODULES) == []


def test_the_size_check_names_what_is_too_long():
    body = "\n".join(f"    x{k} = {k}" for k in range(MAX_FUNCTION_LINES))
    long_function = f"def f():\n{body}\n"
    long_file = "\n" * (MAX_FILE_LINES + 1)
    assert oversized({"optpipe.core.a": (long_function, False), "optpipe.core.b": (long_file, False)}) == [
        f"optpipe.core.a.f: {MAX_FUNCTION_LINES + 1} lines", f"optpipe.core.b: {MAX_FILE_LINES + 1} lines"]
