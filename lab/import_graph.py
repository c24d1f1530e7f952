"""The project's import structure as text: who imports whom, drawn in floors.

    python lab/import_graph.py                      # the folders, then the modules of each package
    python lab/import_graph.py --modules spherical_kv_ref cupy_kernels

A module's floor is 1 + the highest floor of what it imports inside its own folder (floor 1
imports nothing there), so every arrow points down; a circle of imports is reported as such.
Folders are floored the same way on the arrows between them. Every import counts, also the
ones made inside a function (a lazy import is still a dependency). Reads the files with
``ast``; imports nothing of the project. docs/design.md §9 shows its output.
"""
from __future__ import annotations

import argparse
import ast
import pathlib
from collections import defaultdict

FOLDERS = ("spherical_kv_ref", "cupy_kernels", "spherical_kv_eval", "spherical_kv_vllm",
           "reference", "validation", "asv_bench", "lab")


def module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if parts[:2] == ["asv_bench", "benchmarks"]:       # asv puts benchmarks/ on the path
        parts = parts[1:]
    return ".".join(parts)


def imports_of(tree: ast.AST, name: str, is_package: bool) -> set:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def read_tree(root: pathlib.Path):
    """{module: file} and {module: set of modules of the tree it imports}."""
    files = {}
    for folder in FOLDERS:
        for p in sorted((root / folder).rglob("*.py")):
            files[module_name(root, p)] = p
    graph = {}
    for name, p in files.items():
        wanted = imports_of(ast.parse(p.read_text()), name, p.name == "__init__.py")
        deps = set()
        for w in wanted:
            while w and w not in files:              # "pkg.mod.func" -> "pkg.mod"
                w = w.rpartition(".")[0]
            if w and w != name:
                deps.add(w)
        graph[name] = deps
    return files, graph


def floors(nodes, edges):
    """{node: floor}, and the circles found (lists of nodes)."""
    floor, state, circles = {}, {}, []

    def visit(n, stack):
        if state.get(n) == "done":
            return floor[n]
        if state.get(n) == "open":
            circles.append(stack[stack.index(n):] + [n])
            return 0
        state[n] = "open"
        f = 1 + max((visit(m, stack + [n]) for m in edges.get(n, ()) if m in nodes), default=0)
        state[n], floor[n] = "done", f
        return f

    for n in sorted(nodes):
        visit(n, [])
    return floor, circles


def folder_of(module: str) -> str:
    return "asv_bench" if module.startswith("benchmarks") else module.split(".")[0]


def draw_folders(graph) -> list:
    edges = defaultdict(set)
    for a, deps in graph.items():
        for b in deps:
            if folder_of(a) != folder_of(b):
                edges[folder_of(a)].add(folder_of(b))
    nodes = {folder_of(m) for m in graph}
    floor, circles = floors(nodes, edges)
    lines = ["folders (A -> B: a module of A imports one of B)"]
    for n in sorted(nodes, key=lambda n: (-floor[n], n)):
        lines.append(f"  floor {floor[n]}  {n + '/':20s} -> {', '.join(sorted(edges[n])) or '-'}")
    lines += [f"  CIRCLE: {' -> '.join(c)}" for c in circles]
    return lines


def draw_package(graph, files, package: str) -> list:
    mods = {m for m in graph if folder_of(m) == package and m != package}
    edges = {m: {d for d in graph[m] if d in mods} for m in mods}
    floor, circles = floors(mods, edges)
    lines = [f"{package}/ (module: lines -> what it imports inside {package}/; "
             f"outside it: [...])"]
    cut = len(package) + 1
    for m in sorted(mods, key=lambda m: (-floor[m], m)):
        n_lines = len(files[m].read_text().splitlines())
        inside = ", ".join(sorted(d[cut:] for d in edges[m])) or "-"
        outside = sorted({folder_of(d) for d in graph[m] if folder_of(d) != package})
        extra = f"  [{', '.join(outside)}]" if outside else ""
        lines.append(f"  floor {floor[m]}  {m[cut:]:22s} {n_lines:5d}  -> {inside}{extra}")
    lines += [f"  CIRCLE: {' -> '.join(c)}" for c in circles]
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=".", help="the repository (default: here)")
    ap.add_argument("--modules", nargs="*", default=["spherical_kv_ref", "cupy_kernels"],
                    help="packages whose modules are drawn one by one")
    args = ap.parse_args(argv)
    root = pathlib.Path(args.root)
    files, graph = read_tree(root)
    out = draw_folders(graph)
    for package in args.modules:
        out += [""] + draw_package(graph, files, package)
    print("\n".join(out))


if __name__ == "__main__":
    main()
