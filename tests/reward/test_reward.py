"""Rule scorers, the router, user functions by path (per-sample and batched) and the failure kinds."""

import math
import pytest
import torch

from verl_lite.reward.config import CustomRewardFunctionConfig, RewardConfig
from verl_lite.data.char_tokenizer import build_char_tokenizer
from verl_lite.reward import (
    RewardError,
    RewardManager,
    boxed_math_score,
    default_compute_score,
    extract_gsm8k_answer,
    gsm8k_score,
    is_equiv,
    last_boxed_content,
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def enc(tok, texts, eos=True):
    return [tok.encode(t, add_special_tokens=False) + ([tok.eos_token_id] if eos else []) for t in texts]


# ---------------------------------------------------------------- scorers


def test_gsm8k():
    assert extract_gsm8k_answer("so 3+4=7\n#### 7") == "7"
    assert extract_gsm8k_answer("#### 5 then #### 1,234") == "1234"  # last match, commas stripped
    assert extract_gsm8k_answer("#### -3.5") == "-3.5"
    assert extract_gsm8k_answer("no answer 7") is None
    # only the last 300 characters are searched
    assert extract_gsm8k_answer("#### 9" + "x" * 300) is None
    assert gsm8k_score("The total is #### 1,000", "1000") == 1.0
    assert gsm8k_score("#### 999", "1000") == 0.0
    assert gsm8k_score("1000", "1000") == 0.0  # no '####'
    assert default_compute_score("openai/gsm8k", "blah #### 42", "42") == 1.0


def test_boxed():
    assert last_boxed_content(r"a \boxed{1} b \boxed{\frac{1}{2}} c") == r"\frac{1}{2}"
    assert last_boxed_content(r"\boxed{x^{2}}") == "x^{2}"
    assert last_boxed_content(r"\fbox{7}") == "7"
    assert last_boxed_content(r"\boxed{unbalanced") is None
    assert last_boxed_content("none") is None
    assert is_equiv(r"\dfrac{1}{2}", r"\frac12")
    assert is_equiv("0.5", r"\frac{1}{2}")
    assert is_equiv("3/4", r"\frac{3}{4}")
    assert is_equiv(r"\left( 1, 2 \right)", "(1,2)")
    assert is_equiv(r"90^\circ", "90")
    assert is_equiv("5.00", "5") and is_equiv("1,000", "1000")
    assert not is_equiv("3", "4")
    assert boxed_math_score(r"thus \boxed{\dfrac{3}{4}}.", "3/4") == 1.0
    assert boxed_math_score(r"thus \boxed{2}", r"\boxed{3}") == 0.0
    assert boxed_math_score("answer 3/4", "3/4") == 0.0  # not boxed
    assert default_compute_score("lighteval/MATH", r"\boxed{10}", "10") == 1.0


def test_synthetic_and_router():
    assert default_compute_score("synthetic/addition", "432", "432") == 1.0
    assert default_compute_score("synthetic/addition", " 432 ", "432") == 1.0
    assert default_compute_score("synthetic/addition", "4320", "432") == 0.0
    with pytest.raises(NotImplementedError, match="custom_reward_function"):
        default_compute_score("my/unknown", "x", "y")


# ---------------------------------------------------------------- managers


def _cfg(path=None, name="compute_score", manager="naive", **kw):
    return RewardConfig(reward_manager=manager,
                        custom_reward_function=CustomRewardFunctionConfig(path=path, name=name, reward_kwargs=kw))


def test_default_manager_decodes_without_eos(tok):
    m = RewardManager(_cfg(), tok)
    scores, extra = m(enc(tok, ["12", "13", "#### 5"]), ["synthetic/addition"] * 2 + ["openai/gsm8k"],
                      ["12", "12", "5"], [None] * 3)
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 0.0, 1.0]
    assert extra == {}
    mb = RewardManager(_cfg(manager="batch"), tok)
    assert mb(enc(tok, ["12", "13"]), ["synthetic/addition"] * 2, ["12", "12"], [None] * 2)[0].tolist() == [1.0, 0.0]


USER_FILE = '''
import math
def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": float(solution_str == ground_truth) + bonus, "length": len(solution_str), "src": data_source}
def batch_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
    return [scale * len(s) + (e or {}).get("k", 0) for s, e in zip(solution_strs, extra_infos)]
def raises(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "bad":
        raise KeyError("boom")
    return 1.0
def nan(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan if solution_str == "bad" else 0.0
def inf(data_source, solution_str, ground_truth, extra_info=None):
    return -math.inf
def text(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"
def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}
def short_batch(data_sources, solution_strs, ground_truths, extra_infos):
    return [0.0] * (len(solution_strs) - 1)
def raising_batch(data_sources, solution_strs, ground_truths, extra_infos):
    raise ValueError("batch boom")
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("rw") / "my_reward.py"
    p.write_text(USER_FILE)
    return str(p)


def test_custom_function_by_path_with_dict_and_kwargs(tok, user_file):
    m = RewardManager(_cfg(user_file, "compute_score", bonus=0.5), tok)
    scores, extra = m(enc(tok, ["ab", "abc"]), ["d1", "d2"], ["ab", "ab"], [{}, {}])
    assert scores.tolist() == [1.5, 0.5]
    assert extra == {"length": [2, 3], "src": ["d1", "d2"]}


def test_batched_custom_function(tok, user_file):
    m = RewardManager(_cfg(user_file, "batch_score", manager="batch", scale=2.0), tok)
    scores, _ = m(enc(tok, ["a", "abcd", ""]), ["s"] * 3, ["x"] * 3, [{"k": 1}, {}, None])
    assert scores.tolist() == [2.0 * 1 + 1, 2.0 * 4, 0.0]


@pytest.mark.parametrize(
    "name,manager,match",
    [
        ("raises", "naive", r"my_reward\.py:raises raised KeyError.*sample 1 \(data_source='src1'\)"),
        ("nan", "naive", r"my_reward\.py:nan on sample 1 \(data_source='src1'\) returned a non-finite score nan"),
        ("inf", "naive", r"my_reward\.py:inf on sample 0 \(data_source='src0'\) returned a non-finite score -inf"),
        ("text", "naive", r"my_reward\.py:text on sample 0 .* returned '1.0' of type str"),
        ("no_score", "naive", r"my_reward\.py:no_score on sample 0 .*without 'score'"),
        ("short_batch", "batch", r"my_reward\.py:short_batch returned 1 scores for 2 samples"),
        ("raising_batch", "batch", r"my_reward\.py:raising_batch raised ValueError: batch boom"),
    ],
)
def test_failures_name_function_and_sample(tok, user_file, name, manager, match):
    m = RewardManager(_cfg(user_file, name, manager=manager), tok)
    with pytest.raises(RewardError, match=match) as info:
        m(enc(tok, ["ok", "bad"]), ["src0", "src1"], ["x", "x"], [None, None])
    if name in ("raises", "raising_batch"):
        assert isinstance(info.value.__cause__, (KeyError, ValueError))  # original exception chained


def test_bad_path_and_name(tok, user_file):
    with pytest.raises(RewardError, match="does not exist"):
        RewardManager(_cfg("/nonexistent/r.py"), tok)
    with pytest.raises(RewardError, match="no function 'missing'"):
        RewardManager(_cfg(user_file, "missing"), tok)


def test_length_mismatch_and_numeric_types(tok):
    m = RewardManager(_cfg(), tok, compute_score=lambda **kw: torch.tensor(1.0))
    assert m(enc(tok, ["a"]), ["s"], ["g"], [None])[0].tolist() == [1.0]
    import numpy as np

    m = RewardManager(_cfg(), tok, compute_score=lambda **kw: np.float32(0.25))
    assert m(enc(tok, ["a"]), ["s"], ["g"])[0].tolist() == [0.25]
    with pytest.raises(ValueError, match="2 responses but 1 data_sources"):
        m(enc(tok, ["a", "b"]), ["s"], ["g", "g"])
    assert not math.isnan(m(enc(tok, ["a"]), ["s"], ["g"])[0].item())
