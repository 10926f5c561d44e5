"""No comment or docstring under ``verl_lite/`` quotes a timing or a speed figure.

A figure measured on one machine on one day (``84.5 -> 72.5 ms``, ``1.44x``, ``10-12% faster``,
``takes ~3 s``) is wrong on the next machine and cannot be kept true by a test; it belongs in
``docs/performance.md``, the dated record. A comment states the contract or the reason instead.
Limits that are parameters are not measurements and pass: a threshold in elements, ``timeout_s``,
"a bound on each call (seconds)", a whole-second default ("30 s").

Every ``.py`` file is read with :mod:`tokenize` (``COMMENT`` tokens) and :mod:`ast` (the docstrings of
the module, its classes and functions); each line of them is matched against :data:`TIMING`.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "verl_lite"

_BARE_RANGE = r"\d+(?:[.,]\d+)?(?:\s*(?:-|–|to)\s*\d+(?:\.\d+)?)?"  # "13", "12.9", "2,394", "12.9-13.3"
_RANGE = r"(?<![\w.])" + _BARE_RANGE
_MEASURED_NUMBER = (  # a figure with a fraction, a range or a "~"/"about": not a whole-number default
    r"(?:(?:~|about |around |roughly )\s*\d+(?:\.\d+)?"
    r"|(?<![\w.])\d+\.\d+"
    r"|(?<![\w.])\d+(?:\.\d+)?\s*(?:-|–|to)\s*\d+(?:\.\d+)?)"
)
TIMING = re.compile("|".join([
    _RANGE + r"\s*(?:ms|msec|us|µs|ns)\b",                                    # sub-second units: always measured
    _MEASURED_NUMBER + r"\s*(?:s|secs?|seconds|min|minutes|CPU-s|CPU seconds)\b",
    r"(?:->|against|vs\.?)\s*\d+(?:\.\d+)?\s*(?:s|seconds|min)\b",          # "42 -> 36 s", "76 s against 42 s"
    r"(?<![\w.])(?<!>=)(?<!>= )\d+\.\d+x\b",                                # "1.44x" (not "transformers >= 5.2x")
    r"~\s*\d+(?:\.\d+)?x\b",                                                 # "~30x"
    r"\d+(?:\.\d+)?\s*x\s+(?:faster|slower|quicker|cheaper|the speed|as fast)",
    _RANGE + r"\s*%\s*(?:faster|slower|quicker|cheaper)",                    # "10-12% faster"
    r"(?:saves?|costs?|gains?|cuts?|measured)\s+[~+-]?" + _BARE_RANGE + r"\s*%",
    _RANGE + r"\s*%\s+of\s+(?:\S+\s+){0,4}?(?:time|step|generate|generation|peak|wall|run|update)\b",
    r"[GTM]FLOP/?s\b|GFLOP",
    r"\d[\d,.]*\s*(?:tokens|tok|steps|samples|rows|it)/(?:s|sec|min)\b",
    r"\b(?:faster|slower) by\s+\d",
]), re.IGNORECASE)


def comment_and_docstring_lines(source: str):
    """``(line number, text)`` of every comment and of every line of every docstring in ``source``."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                for offset, line in enumerate(doc.value.value.splitlines()):
                    yield doc.lineno + offset, line


def timings_in(source: str) -> list[tuple[int, str]]:
    """The comment/docstring lines of ``source`` that quote a timing or a speed figure, in line order."""
    return sorted((line, text.strip()) for line, text in comment_and_docstring_lines(source) if TIMING.search(text))


def test_detector_finds_planted_timings():
    planted = '''"""Module doc: the step went 84.5 -> 72.5 ms."""
x = 1  # 1.44x the old speed
def f():
    """Takes ~3 s on the 2-core machine.

    10-12% faster than before; 137 GFLOP/s; 2,394 tokens/s; 180 us against 126 us."""
y = 2  # ~30x to unpickle; took 76-87 s against 42 s; saves ~6% of a train step
'''
    found = timings_in(planted)
    assert [line for line, _ in found] == [1, 2, 4, 6, 7], found


def test_detector_passes_contracts():
    contracts = '''"""timeout_s: a bound on each call (seconds); 30 s by default; waits up to timeout_s."""
LIMIT = 4096  # matmul attention below this many elements (16 MiB in float32): faster on the CPU there
V = 5  # transformers >= 5.2x names the argument `cache`; Llama-3 RoPE scaling x8; h % g == 0
def f():
    """Entropy in float32; 2 threads per rank; 100% of the rows; up to 3 attempts; step 2 of 5."""
'''
    assert timings_in(contracts) == []


def test_no_timings_in_verl_lite():
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line, text in timings_in(path.read_text())
    ]
    assert not offenders, (
        "comments/docstrings quote timings of one machine (move the figure to docs/performance.md and state "
        "the contract or the reason instead):\n" + "\n".join(offenders))
