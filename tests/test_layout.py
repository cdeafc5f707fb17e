"""The package's shape, read from its source: imports form no loop (every module imports only modules below it),
no private name crosses a file, each public submodule is reachable from `import jaxnn`, and the command line's
package starts without jax."""

import ast
import importlib.util
import pathlib
import subprocess
import sys

import pytest

import jaxnn

ROOT = pathlib.Path(jaxnn.__file__).parent


def module_names() -> dict[str, pathlib.Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(module: str, path: pathlib.Path, node: ast.Import | ast.ImportFrom, known) -> list[str]:
    """The jaxnn modules an import statement loads (`from a import b` loads a.b when that is a module, else a)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names if base in known]


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    """Module -> the jaxnn modules it imports anywhere (deferred imports in functions included), and every
    private name imported from another jaxnn module."""
    known = module_names()
    graph, private = {}, []
    for module, path in known.items():
        graph[module] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[module] |= set(imported(module, path, node, known)) - {module}
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxnn"):
                private += [f"{module} imports {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return graph, private


def find_loop(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop as a path `a -> b -> ... -> a`, or None (depth-first search with colours)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (loop := visit(dep)):
                return loop
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (loop := visit(node)):
            return loop
    return None


def test_find_loop_finds_a_loop_and_accepts_a_tree():
    assert find_loop({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_loop({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_imports_form_no_loop():
    graph, _ = import_graph()
    assert len(graph) > 40 and "jaxnn.cli.main" in graph["jaxnn.cli"]
    loop = find_loop(graph)
    assert loop is None, "import loop: " + " -> ".join(loop)


def test_no_private_name_is_imported_across_files():
    _, private = import_graph()
    assert private == []


@pytest.mark.system
def test_every_public_submodule_is_an_attribute_of_jaxnn_and_the_cli_starts_without_jax():
    top_level = {name.split(".")[1] for name in module_names() if name.count(".") >= 1}
    assert top_level - {"_src"} == set(jaxnn.SUBMODULES)
    code = (
        "import sys, jaxnn, jaxnn.cli; assert 'jax' not in sys.modules, 'jaxnn.cli loaded jax'; "
        "assert callable(jaxnn.layers.Dense) and callable(jaxnn.evaluate) and jaxnn.profile.Profile; "
        "import inspect; assert 'steps' in inspect.signature(jaxnn.fit).parameters"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_package_keeps_few_root_modules_and_marks_its_internals():
    root = sorted(p.stem for p in ROOT.glob("*.py") if p.stem != "__init__")
    assert len(root) <= 20, root
    internal = {name for name in module_names() if any(part.startswith("_") for part in name.split(".")[1:])}
    assert {name.split(".")[1] for name in internal if name.startswith("jaxnn._src")} == {"_src"}
    # Nothing a user imports (jaxnn's public modules, the API reference's modules) is internal.
    public = {f"jaxnn.{name}" for name in jaxnn.SUBMODULES}
    assert not public & internal
    docs = (ROOT.parent / "tools" / "build_docs.py").read_text()
    assert not [name for name in internal if f'"{name}"' in docs]


# Sizes: a module a reader takes in whole. No file over 600 lines, at most 6 over 400 (3 are today: the loop's run,
# saving.py, layers/conv.py); the next feature in one of those goes to a new file.
MAX_LINES, LONG_LINES, MAX_LONG_FILES = 600, 400, 6


def test_no_module_is_too_long_and_few_are_long():
    lines = {str(path.relative_to(ROOT.parent)): len(path.read_text().splitlines()) for path in ROOT.rglob("*.py")}
    too_long = sorted(name for name, n in lines.items() if n > MAX_LINES)
    assert not too_long, f"over {MAX_LINES} lines: {too_long}"
    long = sorted(name for name, n in lines.items() if n > LONG_LINES)
    assert len(long) <= MAX_LONG_FILES, f"{len(long)} files over {LONG_LINES} lines: {long}"


# ------------------------------------------------------------------------------------------------------- the rooms
# A room is a package or a root module of jaxnn (`jaxnn.layers`, `jaxnn.train`); `jaxnn._src` is one room. Rooms
# should import each other only downward, so the room graph has no loop. The list of imports that still sit on a
# loop may only shrink; it is empty now, and a new one fails here.
KNOWN_UPWARD: set[tuple[str, str]] = set()


def room_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def room_graph() -> dict[str, set[str]]:
    graph, _ = import_graph()
    rooms: dict[str, set[str]] = {}
    for module, deps in graph.items():
        rooms.setdefault(room_of(module), set()).update(room_of(d) for d in deps)
    return {room: deps - {room} for room, deps in rooms.items() if room != "jaxnn"}


def reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Room imports a -> b where b also reaches a: the edges of the room graph's loops."""
    return {(a, b) for a, deps in graph.items() for b in deps if reaches(graph, b, a)}


def test_upward_imports_between_rooms_only_shrink():
    upward = upward_imports(room_graph())
    assert upward <= KNOWN_UPWARD, f"new room imports that run back up: {sorted(upward - KNOWN_UPWARD)}"
    assert not KNOWN_UPWARD - upward, f"gone, strike from KNOWN_UPWARD: {sorted(KNOWN_UPWARD - upward)}"
    assert not any(room.startswith(("experiments", "benchmarks")) for deps in room_graph().values() for room in deps)


# Names a package resolves by string from a room above it, on attribute access only (deprecation tables, removed
# in 0.2); a face that gains another fails here.
MOVED_UP = {
    "jaxnn.parallel": {
        "forms",
        "DataParallelStep",
        "FORMS",
        "bn_axis_name",
        "data_parallel_train_step",
        "per_device_step_fn",
    },
}


def test_parallel_imports_only_internals_and_names_the_moved_step_by_string_only():
    import jaxnn.parallel

    assert room_graph()["jaxnn.parallel"] <= {"jaxnn._src", "jaxnn.errors"}
    assert set(jaxnn.parallel._MOVED) == MOVED_UP["jaxnn.parallel"]
    assert all(target.startswith("jaxnn.train.data_parallel") for target in jaxnn.parallel._MOVED.values())


def test_experiments_import_no_benchmark():
    # Benchmarks stand above the experiments (they may reuse an experiment's measurement), never below them.
    found = []
    for path in sorted((ROOT.parent / "experiments").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            found += [f"{path.name} imports {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert found == []


def test_upward_imports_are_found_through_other_rooms():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert upward_imports(graph) == {("a", "b"), ("b", "c"), ("c", "a")}


# Error classes defined outside jaxnn.errors, and why.
ERRORS_ELSEWHERE = {
    ("jaxnn.cli.main", "UsageError"): "the command's own flag errors; a user sees its one line",
    ("jaxnn.serve.requests", "BadRequest"): "an HTTP refusal; a client sees it as the OpenAI API's error body",
}


def test_every_error_a_user_catches_lives_in_jaxnn_errors_with_a_docstring():
    import jaxnn.errors

    found = set()
    for module, path in module_names().items():
        for node in ast.walk(ast.parse(path.read_text())):
            bases = [getattr(b, "id", getattr(b, "attr", "")) for b in getattr(node, "bases", [])]
            if isinstance(node, ast.ClassDef) and any(b.endswith(("Error", "Exception", "Warning")) for b in bases):
                found.add((module, node.name))
    assert {name for module, name in found if module == "jaxnn.errors"} == set(jaxnn.errors.__all__)
    assert {k for k in found if k[0] != "jaxnn.errors"} == set(ERRORS_ELSEWHERE)
    assert all(getattr(jaxnn.errors, name).__doc__ for name in jaxnn.errors.__all__)


def test_the_docs_layout_names_every_file_of_the_package():
    text = (ROOT.parent / "docs" / "index.md").read_text()
    layout = text.split("## The package's layout", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("`")[1]: line for line in layout.splitlines() if line.startswith("| `jaxnn/")}
    folders = sorted(f"jaxnn/{p.name}/" for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert sorted(rows) == folders
    missing = []
    for folder, row in rows.items():
        for path in sorted((ROOT.parent / folder).rglob("*")):
            if (
                path.suffix in (".py", ".cc")
                and path.stem not in ("__init__", "__main__")
                and f"`{path.name}`" not in row
            ):
                missing.append(f"{folder}{path.relative_to(ROOT.parent / folder)}")
    roots = sorted(p.name for p in ROOT.glob("*.py") if p.stem != "__init__")
    top = layout.split("The modules at the top:", 1)[1]
    missing += [name for name in roots if f"`{name}`" not in top]
    assert missing == [], "docs/index.md's layout does not name: " + ", ".join(missing)
    assert f"holds {len(roots)} modules" in layout


def load_duplicate_lines():
    spec = importlib.util.spec_from_file_location("duplicate_lines", ROOT.parent / "tools" / "duplicate_lines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_duplicate_scanner_finds_a_known_repeat_and_ignores_what_it_should():
    dup = load_duplicate_lines()
    body = "".join(f"    v{i} = w{i} + {i}\n" for i in range(7))
    a = f'import os\n\n\ndef f(w):\n    """Doc."""\n{body}    return v6\n'
    # the same lines with other names and numbers, a comment and a blank line among them, in another file
    b = "x = 1\n\n\ndef g(u):\n" + body.replace("    v3", "    # why\n\n    v3").replace("w", "u") + "    return v6\n"
    assert dup.find_pairs({"a.py": a, "b.py": b}) == []  # other names: not the same to the letter
    pairs = dup.find_pairs({"a.py": a, "b.py": b}, shape=True)
    assert pairs == [(dup.Place("a.py", 4, 13), dup.Place("b.py", 4, 14))]  # one pair, the comment passed over
    changed = b.replace("v3 = u3 + 3", "v3 = u3 * 3")  # splits it into two runs of 4 and 4 logical lines
    assert dup.find_pairs({"a.py": a, "b.py": changed}, shape=True) == []
    same = dup.find_pairs({"a.py": a, "c.py": a.replace("import os", "from os import path")})
    assert same == [(dup.Place("a.py", 4, 13), dup.Place("c.py", 4, 13))]
    assert dup.find_pairs({"a.py": a}) == [] and dup.find_pairs({"a.py": a + a.replace("def f", "def h")}) != []
    assert dup.find_pairs({"d.py": "".join(f"x{i}: int\n" for i in range(12)) * 2}, shape=True) == []


# Pairs of places in jaxnn/ that share 6 or more logical lines of the same shape (tools/duplicate_lines.py: names,
# strings and numbers as placeholders; docstrings, imports, class headers and annotated fields left out, so a
# signature or a keyword call is one line and a list of declarations is not logic repeated). After the clean-up
# that set this limit it finds none; the external `duplicates --repo jaxnn`, which compares physical lines and
# counts declarations (signatures, argparse flags, dataclass fields), reported 31 pairs for the same tree.
MAX_DUPLICATE_PAIRS = 0


def test_repeated_code_stays_under_its_limit():
    dup = load_duplicate_lines()
    pairs = dup.find_pairs(dup.package_sources(ROOT), shape=True)
    listed = "\n".join(f"{a.name}:{a.first}-{a.last} ~ {b.name}:{b.first}-{b.last}" for a, b in pairs)
    assert len(pairs) <= MAX_DUPLICATE_PAIRS, (
        f"{len(pairs)} pairs of repeated code (limit {MAX_DUPLICATE_PAIRS}); give the logic one function:\n{listed}"
    )
