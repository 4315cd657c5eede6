"""The package's imports run one way: no cycles, no private names across modules, layers respected; and its
signatures stay short and typed: no function takes more than 12 parameters, most public parameters are annotated.

Walks the source with `ast` (nothing is imported), so a cycle hidden inside a function still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "cryorefine"

# higher layers may import lower ones, never the reverse (cli → jobs → runners → em → the rest → gpu)
LAYERS = {"cli": 6, "__main__": 6, "jobs": 5, "runners": 4, "em": 3, "gpu": 1, "errors": 1}
BOTTOM = 2  # estep, io, core, data, images, report, density, config …


def module_name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path):
    """(imported module, [names], line) of every import in a file, relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.append((base, [a.name for a in node.names], node.lineno))
    return found


def graph():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for module, names, _ in imports_of(path):
            if not module.startswith("cryorefine"):
                continue
            for imported in names or [None]:  # `from pkg import module` imports the module
                full = f"{module}.{imported}" if imported and f"{module}.{imported}" in modules else module
                if full in modules and full != name:
                    targets.add(full)
        edges[name] = targets
    return modules, edges


def layer(module):
    parts = module.split(".")
    return LAYERS.get(parts[1], BOTTOM) if len(parts) > 1 else BOTTOM


def test_there_is_no_import_cycle():
    _, edges = graph()
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(edges[node]):
            if state.get(target) == "open":
                cycle = stack[stack.index(target):] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_no_module_imports_another_modules_private_names():
    modules, _ = graph()
    offences = []
    for name, path in modules.items():
        for module, names, line in imports_of(path):
            if module.startswith("cryorefine") and module != name:
                offences += [f"{path.name}:{line} imports {module}.{n}" for n in names if n.startswith("_")
                             and not n.startswith("__")]
    assert not offences, offences


def test_imports_run_from_the_command_line_down_to_the_engines():
    _, edges = graph()
    upward = [f"{a} -> {b}" for a, targets in edges.items() for b in targets
              if layer(b) > layer(a) and not (a == "cryorefine" or b.endswith("__init__"))]
    assert not upward, upward


def test_the_walk_sees_the_package():
    """The checks above are only as good as the graph: it must hold the modules and the edges we know of."""
    modules, edges = graph()
    assert {"cryorefine.cli", "cryorefine.em.loop", "cryorefine.runners.mpi", "cryorefine.jobs.refine"} <= set(modules)
    assert "cryorefine.em.loop" in edges["cryorefine.jobs.refine"]
    assert "cryorefine.em.estep" in edges["cryorefine.runners.mpi"]


# the signatures: no function takes more than MAX_PARAMETERS, and most public parameters are typed
MAX_PARAMETERS = 12
TYPED_SHARE = 0.70


def functions():
    """(module.qualified name, parameters but self and cls) of every function and method in the package, nested ones
    too, each parameter an `ast.arg` (its `annotation` None where it has none)."""
    found = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                params = a.posonlyargs + a.args + a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p is not None]
                found.append((f"{prefix}.{child.name}", [p for p in params if p.arg not in ("self", "cls")]))
                visit(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")
            else:
                visit(child, prefix)

    for path in sorted(PACKAGE.rglob("*.py")):
        visit(ast.parse(path.read_text(), str(path)), module_name(path))
    return found


def test_no_function_takes_more_than_twelve_parameters():
    """Related values travel together (a frozen dataclass, or the object that holds them), not as a long list."""
    long = [f"{name} ({len(params)})" for name, params in functions()
            if len(params) > MAX_PARAMETERS]
    assert not long, f"more than {MAX_PARAMETERS} parameters: {long}"


def test_most_parameters_of_public_functions_are_typed():
    """Of the parameters of functions and methods whose names do not start with `_`, at least TYPED_SHARE are
    annotated."""
    params = [p for name, ps in functions() if not name.rpartition(".")[2].startswith("_") for p in ps]
    typed = sum(p.annotation is not None for p in params)
    assert params and typed >= TYPED_SHARE * len(params), \
        f"{typed} of {len(params)} parameters of public functions typed ({typed / len(params):.0%})"
