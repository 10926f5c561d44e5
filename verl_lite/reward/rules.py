"""The reward section's rules, stated once here and collected by ``verl_lite.config.validate``
(stdlib only: no reward code runs and nothing heavy is imported while the config is checked).

    reward_problems(reward_section) -> list[str]   # one line per problem, naming the key
"""

from __future__ import annotations

import ast
from pathlib import Path

REWARD_MANAGERS = ("naive", "batch")  # reward.reward_manager's names (verl's dapo is an alias of naive)


def reward_problems(rw) -> list[str]:
    """The ``reward`` section: a known manager and, when given, a custom reward file that defines the name."""
    p = []
    if rw.reward_manager not in REWARD_MANAGERS:
        p.append(f"reward.reward_manager={rw.reward_manager!r} is unknown; choose one of {list(REWARD_MANAGERS)}")
    crf = rw.custom_reward_function
    if crf.path:
        p.extend(reward_function_problems(crf.path, crf.name, "reward.custom_reward_function"))
    return p


def reward_function_problems(path: str, name: str, key: str) -> list[str]:
    """The file exists, parses, and names `name` at top level, checked WITHOUT running it: the reward
    manager imports it exactly once, in the reward process, and reports import errors and a
    signature that does not fit reward_kwargs there (still before anything starts)."""
    file = Path(path)
    if not file.is_file():
        return [f"{key}.path={path!r} does not exist; give the path of a python file defining '{name}'"]
    try:
        tree = ast.parse(file.read_text(), filename=str(file))
    except (SyntaxError, ValueError, UnicodeDecodeError) as e:
        return [f"{key}.path={path!r} does not parse ({type(e).__name__}: {e}); fix the file"]
    defined: set[str] = set()
    functions: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
            if not node.name.startswith("_"):
                functions.append(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update(name if a.name == "*" else (a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif not isinstance(node, (ast.Expr,)):
            defined.add(name)  # defined under if/try/...: leave the check to the reward manager's import
    if name in defined:
        return []
    return [f"{key}.name={name!r}: {path} defines no function of that name; set {key}.name to one of {sorted(functions)}"]
