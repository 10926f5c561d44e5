"""Built-in rule scorers and the `default_compute_score` router (verl's signature).

    compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict

- GSM8K (`openai/gsm8k`): the last `#### <number>` in the last 300 characters of the
  response, with `,` and `$` removed, must equal the ground truth string -> 1.0, else 0.0.
- MATH-style (`\\boxed{}`; data sources containing "math", "aime", "amc", "olympiad", "boxed"):
  the content of the LAST `\\boxed{...}` (or `\\fbox{...}`) and the ground truth, normalised by
  `normalize_math_answer`, compared as strings -> 1.0, else 0.0 (no symbolic equivalence).
- The synthetic task (`synthetic/addition`): exact match of the stripped response.
"""

from __future__ import annotations

import re

from verl_lite.data.synthetic import DATA_SOURCE as SYNTHETIC_ADDITION, score_addition

_GSM8K_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_gsm8k_answer(solution_str: str) -> str | None:
    """The last `#### <number>` in the last 300 characters, without `,` and `$`; None if absent."""
    matches = _GSM8K_RE.findall(solution_str[-300:])
    return matches[-1].replace(",", "").replace("$", "") if matches else None


def gsm8k_score(solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    answer = extract_gsm8k_answer(solution_str)
    if answer is None:
        return 0.0
    return score if answer == str(ground_truth).replace(",", "").replace("$", "").strip() else format_score


# ---------------------------------------------------------------- \boxed{} math answers


def last_boxed_content(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (braces balanced) or `\\boxed x`; None if absent."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    rest = text[idx:]
    if rest.startswith("\\boxed "):  # "\boxed 5"
        return rest[len("\\boxed "):].split("$")[0].strip()
    brace = rest.find("{")
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(rest)):
        if rest[i] == "{":
            depth += 1
        elif rest[i] == "}":
            depth -= 1
            if depth == 0:
                return rest[brace + 1:i]
    return None  # unbalanced


def _fix_fracs(s: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{2} -> \\frac{1}{2}."""
    parts = s.split("\\frac")
    out = parts[0]
    for p in parts[1:]:
        out += "\\frac"
        if p.startswith("{") or len(p) < 2:
            out += p
            continue
        a, rest = p[0], p[1:]
        if rest.startswith("{"):
            out += "{" + a + "}" + rest
        else:
            out += "{" + a + "}{" + rest[0] + "}" + rest[1:]
    return out


def _fix_a_slash_b(s: str) -> str:
    """'3/4' (two integers) -> \\frac{3}{4}."""
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def normalize_math_answer(s: str) -> str:
    """String normalisation for answer equivalence (after Hendrycks' MATH `is_equiv`): spaces, `\\left/\\right`,
    `\\!`, `dfrac/tfrac -> frac`, `^\\circ`, `$`, trailing text units, `\\frac12 -> \\frac{1}{2}`,
    `a/b -> \\frac{a}{b}`, `0.5 -> \\frac{1}{2}`, `5.00 -> 5`, `1,000 -> 1000`, a short `x =` prefix dropped."""
    s = s.strip().replace("\n", "").rstrip(".")
    s = s.replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = re.sub(r"\\text\{\s*[a-zA-Z ]*\}$", "", s)  # trailing units
    s = re.sub(r"\\(text|mbox|mathrm)\{(.*?)\}", r"\2", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if "=" in s and len(s.split("=")[0].strip()) <= 2:  # "x = 5" -> "5"
        s = s.split("=", 1)[1]
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)  # \sqrt2 -> \sqrt{2}
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    s = _fix_a_slash_b(s)
    if re.fullmatch(r"-?\d+\.0+", s):  # "5.00" -> "5"
        s = s.split(".")[0]
    s = re.sub(r"(?<=\d),(?=\d{3}(\D|$))", "", s)  # 1,000 -> 1000
    return s


def is_equiv(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    try:
        return normalize_math_answer(a) == normalize_math_answer(b)
    except Exception:  # malformed strings: fall back to exact comparison
        return a == b


def boxed_math_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer is equivalent to the ground truth (itself boxed or plain), else 0.0."""
    truth = last_boxed_content(ground_truth) or ground_truth
    return 1.0 if is_equiv(last_boxed_content(solution_str), truth) else 0.0


_MATH_SOURCES = ("math", "aime", "amc", "olympiad", "boxed")


def builtin_scorer(data_source: str):
    """The built-in scorer ``(solution_str, ground_truth) -> float`` for ``data_source``; None if there is none."""
    if data_source == SYNTHETIC_ADDITION:
        return score_addition
    if "gsm8k" in data_source.lower():
        return gsm8k_score
    if any(k in data_source.lower() for k in _MATH_SOURCES):
        return boxed_math_score
    return None


def default_compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None) -> float:
    """Route on data_source to a built-in scorer; unknown sources raise NotImplementedError naming the fix."""
    scorer = builtin_scorer(data_source)
    if scorer is not None:
        return scorer(solution_str, ground_truth)
    raise NotImplementedError(
        f"no built-in scorer for data_source={data_source!r} (built-in: {SYNTHETIC_ADDITION}, openai/gsm8k, "
        f"MATH-style sources containing {_MATH_SOURCES}); set reward.custom_reward_function.path/name"
    )
