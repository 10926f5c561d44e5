"""The package's layers, read from the source with ``ast`` / ``tokenize`` (nothing imported):

- no module imports, directly or through others, a module that imports it back, and no package
  (``verl_lite.<first component>``) imports, through any of its modules, a package that imports it back;
  deferred imports inside functions count; ``verl_lite.config`` imports nothing from ``verl_lite.trainer``;
- the share of verl_lite-internal imports deferred into functions is reported, and held under a ceiling;
- no private attribute of another library (torch, megatron-core, Ray, transformers, vLLM, peft, CPython's own
  modules) is referenced, and no module of another library is patched, outside ``verl_lite/compat/``
  (allow-list: empty).
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "verl_lite"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The verl_lite modules ``path`` imports anywhere in its body (``from pkg import sub`` -> ``pkg.sub``)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_reader_sees_known_edges():
    graph = _graph()
    assert "verl_lite.config.loader" in graph["verl_lite.config.validate"]
    assert "verl_lite.trainer.training_run" in graph["verl_lite.trainer.ppo_trainer"]  # a deferred import


def test_no_import_cycle():
    assert _cycles(_graph()) == []


def test_cycle_detection_finds_a_planted_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_config_imports_nothing_from_trainer():
    graph = _graph()
    bad = {m: sorted(i for i in deps if i.startswith("verl_lite.trainer"))
           for m, deps in graph.items() if m.startswith("verl_lite.config")}
    assert {m: deps for m, deps in bad.items() if deps} == {}


# ---------------------------------------------------------------- package circles


def _package(module: str) -> str:
    """``verl_lite.<first component>`` (a top-level module such as ``verl_lite.errors`` is a package of its own)."""
    return ".".join(module.split(".")[:2])


def _package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        packages.setdefault(_package(module), set()).update(_package(d) for d in deps)
    return {package: deps - {package} for package, deps in packages.items()}


def _edges_between(graph: dict[str, set[str]], packages: list[str]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                  if _package(m) in packages and _package(d) in packages and _package(m) != _package(d))


def test_no_package_circle():
    graph = _graph()
    circles = _cycles(_package_graph(graph))
    assert circles == [], {" <-> ".join(c): _edges_between(graph, c) for c in circles}


def test_package_circle_detection_finds_a_planted_circle():
    planted = {"verl_lite.config.validate": {"verl_lite.reward.rules"}, "verl_lite.reward.rules": {"verl_lite.errors"},
               "verl_lite.reward.manager": {"verl_lite.config.loader"}, "verl_lite.config.loader": set(),
               "verl_lite.errors": set()}
    assert _cycles(planted) == []  # no module circle ...
    assert _cycles(_package_graph(planted)) == [["verl_lite.config", "verl_lite.reward"]]  # ... but a package one


# ---------------------------------------------------------------- deferred (function-level) imports

# The share of verl_lite-internal import statements that sit inside a function. The ones that stay there are lazy on
# purpose: a heavy optional dependency (megatron-core, transformers, vLLM, Ray) behind them, a version check that
# must fail where the library is used, or a circle they avoid. A new deferred import raises the share.
DEFERRED_SHARE_CEILING = 0.25


def _internal_import_sites() -> list[tuple[str, int, bool]]:
    """(module, line, deferred) of every import statement of a verl_lite module inside verl_lite/."""
    sites = []
    for name, path in _modules().items():
        def visit(node, in_function: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import | ast.ImportFrom):
                    target = child.module if isinstance(child, ast.ImportFrom) else child.names[0].name
                    if getattr(child, "level", 0) or (target or "").split(".")[0] == "verl_lite":
                        sites.append((name, child.lineno, in_function))
                visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda))

        visit(ast.parse(path.read_text(), filename=str(path)), False)
    return sites


def test_deferred_import_share_is_reported_and_bounded():
    sites = _internal_import_sites()
    deferred = sum(1 for *_, inside in sites if inside)
    share = deferred / len(sites)
    print(f"verl_lite-internal imports inside functions: {deferred} of {len(sites)} ({share:.0%})")
    assert len(sites) > 100 and deferred > 0  # the walk sees both kinds
    assert share <= DEFERRED_SHARE_CEILING, (
        f"{deferred} of {len(sites)} verl_lite-internal imports ({share:.0%}) sit inside functions, above "
        f"{DEFERRED_SHARE_CEILING:.0%}: import at module level unless the import is lazy on purpose (say why)")


# ---------------------------------------------------------------- other libraries' private internals

COMPAT = PACKAGE / "compat"
LIBRARIES = ("torch", "megatron", "ray", "transformers", "vllm", "peft", "tensordict")
CPYTHON_MODULES = ("warnings", "sys", "threading", "atexit", "gc", "os", "importlib", "inspect", "functools", "pickle",
                   "signal", "logging", "multiprocessing", "asyncio", "socket", "subprocess", "types", "builtins",
                   "typing", "dataclasses", "collections", "weakref", "traceback", "enum", "copyreg", "abc")
# names with a leading underscore that Python documents as public API (os._exit: exit without clean-up)
PUBLIC_UNDERSCORE = frozenset({"os._exit"})
# what the code (comments and docstrings left out) must not say outside compat/, each with an example it catches
PRIVATE_PATTERNS = {
    "a private name on another library's module path": (
        re.compile(rf"\b(?:{'|'.join(LIBRARIES)})(?:\.[A-Za-z]\w*)*\._[A-Za-z]\w*"),
        'torch._C.DisableTorchFunction(); import torch._dynamo; x = "ray._private.worker"'),
    "a private name of a CPython module": (
        re.compile(rf"\b(?:{'|'.join(CPYTHON_MODULES)})\._[A-Za-z]\w*"), "warnings._filters_mutated(); sys._getframe()"),
    "a private member that compat/ reaches into (on any object)": (None, "opt._get_model_param_range_map(p)"),
}
ALLOWED_OUTSIDE_COMPAT: dict[str, str] = {}  # "path:line: what" -> why; empty, and to stay so


def _code_only(source: str) -> str:
    """``source`` with its comments and docstrings blanked out (line numbers kept); other strings stay."""
    docstrings = {(n.lineno, n.col_offset) for n in ast.walk(ast.parse(source))
                  if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}
    lines = source.splitlines(keepends=True)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.start in docstrings):
            (r0, c0), (r1, c1) = tok.start, tok.end
            for row in range(r0, r1 + 1):
                line = lines[row - 1]
                start, end = (c0 if row == r0 else 0), (c1 if row == r1 else len(line.rstrip("\n")))
                lines[row - 1] = line[:start] + " " * (end - start) + line[end:]
    return "".join(lines)


def _private_members_compat_reaches() -> frozenset[str]:
    """The private attribute names compat/ uses on objects other than its own (``opt._get_model_param_range_map``,
    ``torch._C``), and the ones it names to ``getattr``."""
    names = set()
    for path in COMPAT.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) not in ("self", "cls"):
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):
                names.add(str(node.args[1].value))
    public = {name.split(".")[-1] for name in PUBLIC_UNDERSCORE}
    return frozenset(n for n in names if n.startswith("_") and not n.startswith("__") and n not in public)


def _external_module_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the other library's (or CPython's) dotted module path it was imported as, anywhere in the file."""
    external = set(LIBRARIES) | set(sys.stdlib_module_names)
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in external:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in external:
            for a in node.names:
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    return bound


def _dotted(node: ast.AST) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _is_private(part: str) -> bool:
    return part.startswith("_") and not part.startswith("__")


def private_reaches(source: str, where: str, compat_members: frozenset[str]) -> list[str]:
    """Every reach into another library's private internals in ``source``: ``where:line: what``."""
    found = []
    tree = ast.parse(source)
    code = _code_only(source)
    for line_no, line in enumerate(code.splitlines(), 1):
        for what, (pattern, _) in PRIVATE_PATTERNS.items():
            if pattern is not None:
                found += [f"{where}:{line_no}: {m.group(0)} ({what})" for m in pattern.finditer(line)
                          if m.group(0) not in PUBLIC_UNDERSCORE]
    modules = _external_module_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in compat_members:
            found.append(f"{where}:{node.lineno}: .{node.attr} ({'a private member that compat/ reaches into'})")
        elif isinstance(node, ast.Attribute):
            parts = _dotted(node)
            if not parts or parts[0] not in modules:
                continue
            path = ".".join([modules[parts[0]], *parts[1:]])
            if isinstance(node.ctx, ast.Store | ast.Del) and path.split(".")[0] in LIBRARIES:  # sys.stdout = ...: public
                found.append(f"{where}:{node.lineno}: {'.'.join(parts)} = {path} (a patch of another library)")
            elif any(_is_private(p) for p in parts[1:]) and path not in PUBLIC_UNDERSCORE \
                    and ".".join(parts) not in PUBLIC_UNDERSCORE:
                found.append(f"{where}:{node.lineno}: {'.'.join(parts)} = {path} (a private name of an import)")
        elif isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names]
            root = (names[0] if names and names[0] else node.names[0].name).split(".")[0]
            if root in set(LIBRARIES) | set(sys.stdlib_module_names) and any(
                    _is_private(part) for n in names for part in n.split(".")):
                found.append(f"{where}:{node.lineno}: import of {names} (a private module or name)")
        elif isinstance(node, ast.keyword) and node.arg and _is_private(node.arg):
            found.append(f"{where}:{node.lineno}: {node.arg}= (a private keyword argument)")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in compat_members):
            found.append(f"{where}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r}) (a private member)")
    return sorted(set(found))


def test_no_private_internals_of_other_libraries_outside_compat():
    members = _private_members_compat_reaches()
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if COMPAT not in path.parents:
            found += private_reaches(path.read_text(), str(path.relative_to(PACKAGE.parent)), members)
    assert [f for f in found if f not in ALLOWED_OUTSIDE_COMPAT] == []


def test_the_private_reach_finder_catches_each_kind():
    members = _private_members_compat_reaches()
    assert {"_get_model_param_range_map", "_C", "_set_pg_timeout"} <= members
    for what, (_, example) in PRIVATE_PATTERNS.items():
        assert private_reaches(example, "planted.py", members), what
    planted = {
        "import torch.distributed as dist\ndist.distributed_c10d._set_pg_timeout(t, g)\n": "_set_pg_timeout",
        "from megatron.core import parallel_state as ps\nps._global_process_group_list\n": "_global_process_group_list",
        "from torch.optim.optimizer import _get_fused_kernels_supported_devices\n": "_get_fused_kernels",
        "import ray\nray.init(address='local', _system_config={})\n": "_system_config=",
        "import atexit as a\na._run_exitfuncs()\n": "_run_exitfuncs",
        "x = getattr(opt, '_get_model_param_range_map')\n": "_get_model_param_range_map",
        "from torch.distributed.checkpoint import filesystem\nfilesystem.pickle = guarded\n": "a patch",
    }
    for source, name in planted.items():
        assert any(name in f for f in private_reaches(source, "planted.py", members)), source
    clean = ('"""Docstrings may say torch._C."""\nimport os\nos._exit(0)  # comments may say warnings._x\n'
             'self._cache = 1\nengine._reduced_token_count = 2\n')
    assert private_reaches(clean, "clean.py", members) == []
