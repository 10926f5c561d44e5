"""The TRL-facing pieces of the Python API, without a training run: callbacks get their events in
order with the step of the record, generation_kwargs a backend cannot take (and push_to_hub) are
refused before anything starts, the HF rollout's generation_kwargs behave as HF's own generate,
and log_completions becomes a TensorBoard text and a W&B table (offline)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# ---------------------------------------------------------------- callbacks


class Recorder:
    def __init__(self, events):
        self.events = events

    def on_step_end(self, step, metrics):
        self.events.append(("on_step_end", step, sorted(metrics)))

    def on_evaluate(self, step, metrics):
        self.events.append(("on_evaluate", step, sorted(metrics)))

    def on_save(self, step, checkpoint_dir):
        self.events.append(("on_save", step, checkpoint_dir.name))

    def on_log(self, step, logs):
        self.events.append(("on_log", step, sorted(logs)))


class OnlyLog:  # a subset of the methods, taking everything by **kwargs
    def __init__(self, events):
        self.events = events

    def on_log(self, **kwargs):
        self.events.append(("only_log", kwargs["step"], sorted(kwargs)))


def test_callbacks_called_in_order_with_the_record_step(tmp_path):
    from verl_lite.trainer.callbacks import CallbackList

    events: list = []
    trainer = SimpleNamespace(checkpoints=SimpleNamespace(root=tmp_path))
    callbacks = CallbackList([Recorder(events), OnlyLog(events)])
    records = [
        {"step": 0, "val/accuracy": 0.5, "timing_s/validate": 0.1},
        {"step": 1, "reward/mean": 0.2},
        {"step": 2, "reward/mean": 0.3, "val/accuracy": 0.75, "timing_s/save_checkpoint": 0.5},
    ]
    for r in records:
        callbacks.dispatch(trainer, r)
    assert events == [
        ("on_evaluate", 0, ["val/accuracy"]),
        ("on_log", 0, ["step", "timing_s/validate", "val/accuracy"]),
        ("only_log", 0, ["logs", "step", "trainer"]),
        ("on_step_end", 1, ["reward/mean", "step"]),
        ("on_log", 1, ["reward/mean", "step"]),
        ("only_log", 1, ["logs", "step", "trainer"]),
        ("on_step_end", 2, ["reward/mean", "step", "timing_s/save_checkpoint"]),
        ("on_evaluate", 2, ["val/accuracy"]),
        ("on_save", 2, "global_step_2"),
        ("on_log", 2, ["reward/mean", "step", "timing_s/save_checkpoint", "val/accuracy"]),
        ("only_log", 2, ["logs", "step", "trainer"]),
    ]


def test_a_callback_without_events_or_one_that_raises_is_named():
    from verl_lite.trainer.callbacks import CallbackError, CallbackList

    class Nothing:
        pass

    class Broken:
        def on_log(self, step):
            raise KeyError("oops")

    with pytest.raises(ValueError, match=r"Nothing has none of the methods \['on_step_end'"):
        CallbackList([Nothing()])
    with pytest.raises(CallbackError, match=r"callback Broken\.on_log raised KeyError: 'oops' at step 3"):
        CallbackList([Broken()]).dispatch(SimpleNamespace(), {"step": 3})


# ---------------------------------------------------------------- generation_kwargs / push_to_hub


def _exact(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]


ROWS = [{"prompt": f"reverse {w}", "answer": w[::-1]} for w in ("abc", "hello", "xyz", "qwer")] * 4


def _count_ray_starts(monkeypatch) -> list:
    """Every start_ray call the trainer makes from here on (another test's Ray may already be up)."""
    from verl_lite.trainer import placement

    calls: list = []
    real = placement.start_ray
    monkeypatch.setattr(placement, "start_ray", lambda *a, **kw: (calls.append(a), real(*a, **kw))[1])
    return calls


def test_generation_kwarg_the_hf_backend_lacks_is_refused_before_start(monkeypatch):
    ray_starts = _count_ray_starts(monkeypatch)
    from verl_lite.config import load_config
    from verl_lite.config.loader import ConfigError
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    with pytest.raises(ConfigError) as info:
        PPOTrainer(cfg, reward_funcs=_exact, train_dataset=ROWS, val_dataset=ROWS,
                   generation_kwargs={"presence_penalty": 0.5, "max_new_tokens": 4, "min_p": 3.0}, push_to_hub=True)
    lines = info.value.problems
    assert any(line.startswith("generation_kwargs['presence_penalty'] is not supported by rollout.name=hf")
               and "rollout.name=vllm takes it" in line for line in lines), lines
    assert "generation_kwargs['max_new_tokens']: set data.max_response_length instead" in lines
    assert "generation_kwargs['min_p']=3.0 must lie in [0, 1]" in lines
    assert any(line.startswith("push_to_hub=True: uploading to the Hugging Face Hub is not built here")
               for line in lines), lines
    assert ray_starts == []


def test_sampling_keys_of_generation_kwargs_set_the_rollout_config():
    from verl_lite.config import load_config
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    trainer = PPOTrainer(cfg, reward_funcs=_exact, train_dataset=ROWS, val_dataset=ROWS,
                         generation_kwargs={"top_p": 0.9, "top_k": 5, "stop": "\n", "repetition_penalty": 1.1})
    r = cfg.actor_rollout_ref.rollout
    assert (r.top_p, r.top_k) == (0.9, 5)
    assert trainer.generation_kwargs == {"stop": "\n", "repetition_penalty": 1.1}


def test_reward_function_naming_a_missing_column_is_refused_before_start():
    from verl_lite.config import load_config
    from verl_lite.config.loader import ConfigError
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    def needs_truth(completions, ground_truth):
        return [0.0] * len(completions)

    def needs_label(completions, label, **kwargs):
        return [0.0] * len(completions)

    cfg = load_config(["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    with pytest.raises(ConfigError) as info:
        PPOTrainer(cfg, reward_funcs=[needs_truth, needs_label], train_dataset=ROWS, val_dataset=ROWS)
    lines = info.value.problems
    assert any("data.train_files: 16 row(s) have no ground truth (first: <in-memory dataset> row 0) and the reward "
               "needs_truth needs one" in line and "['answer'] by name" in line for line in lines), lines
    assert any("data.val_files: the reward function needs_label needs 'label', which not every row has (columns "
               "every row has: ['answer'])" in line for line in lines), lines


# ---------------------------------------------------------------- the HF backend's generation_kwargs


@pytest.fixture(scope="module")
def hf_rollout():
    from transformers import AutoTokenizer

    from verl_lite.config.loader import default_model_path
    from verl_lite.rollout.hf_rollout import HFRollout

    tok = AutoTokenizer.from_pretrained(default_model_path())
    return HFRollout(default_model_path(), tok), tok


def _prompts(tok):
    from verl_lite.data.dataset import encode_prompt

    return [encode_prompt(tok, [{"role": "user", "content": q}]) for q in ("12+34=", "7+15=", "reverse abc")]


def test_stop_string_cuts_the_same_draws_where_it_first_completes(hf_rollout):
    rollout, tok = hf_rollout
    prompts = _prompts(tok)
    free = rollout.generate(prompts, n=4, max_new_tokens=12, seeds=[1, 2, 3])
    stopped = rollout.generate(prompts, n=4, max_new_tokens=12, seeds=[1, 2, 3], stop=["1", "=2"])
    cut = 0
    for a, b in zip(free, stopped):
        ids = a["response_ids"]
        ends = [k for k in range(1, len(ids) + 1) if any(s in tok.decode(ids[:k]) for s in ("1", "=2"))]
        expected = ids[:ends[0]] if ends else ids  # draws are keyed by (seed, sample, position): a prefix
        assert b["response_ids"] == expected
        # the same draws; the log-probs to float rounding (rows that stop leave the batch, and a batch of another
        # size may sum in another order with several threads)
        torch.testing.assert_close(b["log_probs"], a["log_probs"][:len(expected)], atol=1e-5, rtol=0)
        cut += len(expected) < len(ids)
    assert cut > 0  # the stop strings did stop some responses early


def test_min_p_one_is_greedy_and_repetition_penalty_matches_hf_generate(hf_rollout):
    rollout, tok = hf_rollout
    prompts = _prompts(tok)
    greedy = rollout.generate(prompts, n=1, do_sample=False, max_new_tokens=10)
    only_top = rollout.generate(prompts, n=2, max_new_tokens=10, seeds=[5, 6, 7], min_p=1.0)
    assert [o["response_ids"] for o in only_top] == [g["response_ids"] for g in greedy for _ in range(2)]
    for prompt in prompts:  # one prompt at a time: HF's penalty also counts pad tokens of a padded batch
        [ours] = rollout.generate([prompt], n=1, do_sample=False, max_new_tokens=10, repetition_penalty=1.8)
        ids = torch.tensor([prompt])
        theirs = rollout.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                                        repetition_penalty=1.8, eos_token_id=tok.eos_token_id,
                                        pad_token_id=tok.pad_token_id)[0, len(prompt):].tolist()
        assert ours["response_ids"] == theirs
    plain = [g["response_ids"] for g in greedy]
    penalized = [rollout.generate([p], n=1, do_sample=False, max_new_tokens=10, repetition_penalty=1.8)[0]
                 ["response_ids"] for p in prompts]
    assert penalized != plain  # the penalty changes what greedy decoding picks on this model


# ---------------------------------------------------------------- log_completions


def test_log_completions_writes_a_tensorboard_text_and_a_wandb_table(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from verl_lite.config import load_config
    from verl_lite.trainer.tracking import Tracking

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(["trainer.logger=[jsonl,tensorboard,wandb]", "trainer.experiment_name=completions"])
    rows = [{"prompt": "<|user|>reverse ab<|assistant|>", "completion": "ba", "reward": 1.0, "exact": 1.0},
            {"prompt": "<|user|>reverse cd<|assistant|>", "completion": "c|d", "reward": 0.0, "exact": 0.0}]
    with Tracking(cfg, tmp_path, total_steps=2) as tracking:
        tracking.log({"step": 1, "reward/mean": 0.5, "completions": rows})
        tracking.log({"step": 2, "reward/mean": 0.5})
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.5}]  # no completions in the metrics

    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    [text] = acc.Tensors("completions/text_summary")
    markdown = text.tensor_proto.string_val[0].decode()
    assert text.step == 1
    assert markdown.splitlines() == [
        "| prompt | completion | reward | exact |", "|---|---|---|---|",
        "| <|user|>reverse ab<|assistant|> | ba | 1 | 1 |".replace("<|user|>", "<\\|user\\|>").replace(
            "<|assistant|>", "<\\|assistant\\|>"),
        "| <\\|user\\|>reverse cd<\\|assistant\\|> | c\\|d | 0 | 0 |"]

    [table_file] = list(Path(tmp_path / "wandb").glob("offline-run-*/files/media/table/completions_*.table.json"))
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["step", "prompt", "completion", "reward", "exact"]
    assert table["data"] == [[1, *r.values()] for r in rows]


# ---------------------------------------------------------------- model= / processing_class=


def test_model_object_and_tokenizer_are_saved_and_used_by_path(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_lite.config import load_config
    from verl_lite.config.loader import default_model_path
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    ray_starts = _count_ray_starts(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    cfg = load_config(["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       f"trainer.output_dir={tmp_path}"])
    trainer = PPOTrainer(cfg, model=model, processing_class=tokenizer, reward_funcs=_exact, train_dataset=ROWS)
    m = cfg.actor_rollout_ref.model
    saved = Path(m.path)
    assert saved.parent == tmp_path and m.tokenizer_path == m.path and cfg.critic.model.path == m.path
    weights = load_file(str(saved / "model.safetensors"))
    for name, tensor in model.state_dict().items():
        if name in weights:
            assert torch.equal(weights[name], tensor), name
    assert trainer.tokenizer.encode("12+3=") == tokenizer.encode("12+3=")
    assert ray_starts == []  # the model is written before anything starts

    cfg = load_config(["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    PPOTrainer(cfg, model=default_model_path(), reward_funcs=_exact, train_dataset=ROWS)  # a path: used as it is
    assert cfg.actor_rollout_ref.model.path == default_model_path() == cfg.actor_rollout_ref.model.tokenizer_path


def test_a_transformers_trainer_callback_is_called_as_transformers_calls_it(tmp_path):
    """TRL's callbacks are ``transformers.TrainerCallback`` subclasses: hooks take (args, state, control, ...);
    ``control.should_training_stop`` asks the run to end after that record."""
    from transformers import TrainerCallback

    from verl_lite.trainer.callbacks import CallbackList

    events: list = []

    class StopAtTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            events.append(("on_step_end", state.global_step, state.max_steps, args.output_dir))
            control.should_training_stop = state.global_step >= 2

        def on_log(self, args, state, control, logs=None, **kwargs):
            events.append(("on_log", state.global_step, sorted(logs), len(state.log_history)))

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            events.append(("on_evaluate", state.global_step, sorted(metrics)))

    trainer = SimpleNamespace(checkpoints=SimpleNamespace(root=tmp_path), total_steps=lambda: 5,
                              cfg=SimpleNamespace(trainer=SimpleNamespace(output_dir="out", seed=0)))
    callbacks = CallbackList([StopAtTwo()])
    callbacks.dispatch(trainer, {"step": 0, "val/accuracy": 0.5})
    callbacks.dispatch(trainer, {"step": 1, "reward/mean": 0.2})
    assert not callbacks.stop_requested
    callbacks.dispatch(trainer, {"step": 2, "reward/mean": 0.3})
    assert callbacks.stop_requested
    assert events == [("on_evaluate", 0, ["val/accuracy"]), ("on_log", 0, ["step", "val/accuracy"], 1),
                      ("on_step_end", 1, 5, "out"), ("on_log", 1, ["reward/mean", "step"], 2),
                      ("on_step_end", 2, 5, "out"), ("on_log", 2, ["reward/mean", "step"], 3)]
