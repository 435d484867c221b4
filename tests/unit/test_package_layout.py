"""The package's shape: file and function sizes, module names, where raw configs may go."""

import ast
import collections
import pathlib

from conftest import ROOT

PACKAGE = pathlib.Path(ROOT) / "flaxformer_lite"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def _name(path: pathlib.Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def own_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines a reader goes through to follow a function: its whole span, the nested
    functions (closures) included, its docstring and nested classes left out."""
    lines = set(range(node.lineno, node.end_lineno + 1))
    for sub in ast.walk(node):
        if sub is not node and isinstance(sub, ast.ClassDef):
            lines -= set(range(sub.lineno, sub.end_lineno + 1))
    body = node.body[0] if node.body else None
    if isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant):
        lines -= set(range(body.lineno, body.end_lineno + 1))
    return len(lines)


def test_own_lines_counts_what_a_function_holds_itself():
    source = '''
def outer(x):
    """Docstring
    of two lines."""
    def inner(y):
        return y
    class Inner:
        pass
    return inner(x)
'''
    # The def line, the closure's two lines and the return; the docstring and class not.
    assert own_lines(ast.parse(source).body[0]) == 4


def test_library_files_and_functions_stay_small():
    too_long = []
    for path in MODULES:
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            too_long.append(f"{_name(path)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            is_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if is_function and own_lines(node) > MAX_FUNCTION_LINES:
                too_long.append(f"{_name(path)}::{node.name}: {own_lines(node)} lines")
    assert too_long == []


def test_module_names_say_what_they_hold_once():
    """No two modules share a file name: `search/x.py` beside `models/x.py` reads as one."""
    by_name = collections.defaultdict(list)
    for path in MODULES:
        if path.name != "__init__.py":
            by_name[path.name].append(_name(path))
    assert {k: v for k, v in by_name.items() if len(v) > 1} == {}


def test_only_the_config_package_and_the_commands_read_raw_configs():
    """Every other function takes typed sections (config/run.py's RunConfig and its parts)."""
    allowed = ("config/", "cli/")
    readers = []
    for path in MODULES:
        if _name(path).startswith(allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n.split(".")[0] == "ml_collections" for n in names):
                readers.append(_name(path))
    assert readers == []
