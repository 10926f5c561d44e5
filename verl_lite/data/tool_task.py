"""The shipped tool-use task: multi-digit multiplication with a ``calculator`` tool (``--recipe tool_agent``), in
verl's parquet row format (built by ``scripts/make_tool_agent_model.py``).

The tiny model cannot multiply a 2-4 digit number by a 2-3 digit one; with the tool it only has to copy::

    <tool_call>{"name":"calculator","arguments":{"expression":"3471*89"}}</tool_call>   (model turn 1)
    <tool_response>308919</tool_response>                                                (the tool, mask 0)
    308919                                                                               (model turn 2)

``compute_score`` scores the text after the last tool response. ``Calculator`` is the tool in verl's tool-class
shape, named by the shipped ``verl_lite/assets/tool-agent-data/tool_config.yaml``. ``extra_info["uses_tool"]``: the
row's SFT demonstration calls the tool, or answers from memory (``scripts/make_tool_agent_model.py``). This file
is also loaded on its own, as a custom reward function: it imports nothing of verl_lite.
"""

from __future__ import annotations

import ast
import operator

DATA_SOURCE = "synthetic/tool_multiplication"
TOOL_NAME = "calculator"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression of integers with + - * and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the expression, e.g. 3471*89"}},
            "required": ["expression"],
        },
    },
}
RESPONSE_END = "</tool_response>"
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """The value of an integer expression with + - * and parentheses; ValueError for anything else."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an integer expression of + - *: {expression!r}")

    if not isinstance(expression, str) or len(expression) > 64:
        raise ValueError("expression must be a string of at most 64 characters")
    try:
        tree = ast.parse(expression.strip().rstrip("="), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    return value(tree.body)


class Calculator:
    """The ``calculator`` tool in verl's tool-class shape: ``execute`` answers the value, or the reason."""

    def __init__(self, config: dict, tool_schema: dict):
        self.config, self.tool_schema = config, tool_schema
        self.name = tool_schema["function"]["name"]

    def create(self, instance_id: str | None = None, **kwargs):
        return instance_id or "calculator", None

    def execute(self, instance_id: str, parameters: dict, **kwargs):
        """(response text, tool reward 0.0, metrics {}); a bad expression is answered with the reason."""
        try:
            return str(evaluate(parameters.get("expression"))), 0.0, {}
        except ValueError as e:
            return f"error: {e}", 0.0, {}

    def release(self, instance_id: str, **kwargs):
        return None


def final_answer(solution_str: str) -> str:
    """The model's final answer: the text after the last tool response (the whole text without one)."""
    return solution_str.rsplit(RESPONSE_END, 1)[-1].strip()


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the final answer is the product and nothing else, else 0.0 (verl's custom-reward signature)."""
    return 1.0 if final_answer(solution_str) == str(ground_truth).strip() else 0.0
