"""examples/own_task.py, a task of one's own through the Python API (one launch, 2 steps): TRL-style
rows (a prompt and a free-form ``answer`` column, nothing else) reach both reward functions by
name, each answer next to its own prompt; the callbacks see every record in order; the
generation_kwargs' stop string ends responses; log_completions writes the step's samples into
TensorBoard. Plus the row shapes RLDataset takes (conversational, plain text, verl's, TRL's)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from tests.e2e.conftest import shared_ray  # noqa: F401  (fixture)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def own_task(tmp_path_factory, shared_ray):  # noqa: F811
    spec = importlib.util.spec_from_file_location("example_own_task", EXAMPLES / "own_task.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trainer, history, printer = module.main(str(tmp_path_factory.mktemp("own_task")), steps=2)
    return module, trainer, history, printer


def test_the_answer_column_reaches_both_reward_functions(own_task):
    module, trainer, _, _ = own_task
    exact = [s for s in module.SEEN if s["function"] == "exact_reversal"]
    partial = [s for s in module.SEEN if s["function"] == "chars_in_place"]
    assert len(exact) == len(partial) >= 2 + 2  # 2 training steps, 2 validations (step 0 and 2)
    for e, p in zip(exact, partial):
        assert e["answer"] == p["answer"]  # the same column, in the same sample order
        assert len(e["answer"]) == len(e["prompts"]) == len(e["completions"])
        for prompt, answer in zip(e["prompts"], e["answer"]):
            [digits] = re.findall(r"reverse ?(\d+)", prompt)  # (the char tokenizer drops spaces)
            assert answer == digits[::-1], (prompt, answer)
    train_calls = exact[1:3]  # validation at step 0, then the 2 training steps: 8 prompts x 4 samples
    assert [len(c["answer"]) for c in train_calls] == [32, 32]
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows[1:]:
        expected = r["reward/exact_reversal/mean"] + 0.5 * r["reward/chars_in_place/mean"]
        assert abs(r["reward/mean"] - expected) < 1e-5, r


def test_callbacks_saw_every_record_in_order(own_task):
    _, _, history, printer = own_task
    assert [r["step"] for r in history] == [0, 1, 2]
    assert printer.events == [("on_evaluate", 0), ("on_log", 0), ("on_step_end", 1), ("on_log", 1),
                              ("on_step_end", 2), ("on_evaluate", 2), ("on_log", 2)]


def test_stop_string_and_logged_completions(own_task):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    module, trainer, _, _ = own_task
    completions = [c for s in module.SEEN if s["function"] == "exact_reversal" for c in s["completions"]]
    assert all("\n" not in c[:-1] for c in completions)  # the stop string, when drawn, ends the response
    acc = EventAccumulator(str(trainer.run_dir / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors("completions/text_summary")}
    assert sorted(texts) == [1, 2]  # every logging step (log_freq 1), training steps only
    lines = texts[1].splitlines()
    assert lines[0] == "| prompt | completion | reward | exact_reversal | chars_in_place |"
    assert len(lines) == 2 + 32  # header, rule, one row per sample
    step1 = module.SEEN[2]  # the first training step's call (after the step-0 validation's two)
    assert step1["function"] == "exact_reversal"
    cells = [line.split(" | ")[0].lstrip("| ") for line in lines[2:]]
    assert cells == [p.replace("|", "\\|") for p in step1["prompts"]]
    assert "completions" not in (trainer.run_dir / "metrics.jsonl").read_text()


# ---------------------------------------------------------------- row shapes (no training)


@pytest.fixture(scope="module")
def tok():
    from verl_lite.data import build_char_tokenizer

    return build_char_tokenizer()


def test_row_shapes(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_lite.data import RLDataset

    messages = [{"role": "user", "content": "12+3="}]
    rows = [
        {"prompt": messages, "data_source": "synthetic/addition", "reward_model": {"ground_truth": "15"},
         "extra_info": {"split": "train"}},                                       # verl
        {"prompt": messages, "answer": "15"},                                     # TRL, conversational
        {"prompt": "12+3=", "answer": "15", "difficulty": 2},                    # TRL, plain text
        {"prompt": "12+3=", "ground_truth": "15"},                               # ground truth as a column
    ]
    templated = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    files = [str(tmp_path / "conversational.parquet"), str(tmp_path / "plain.parquet")]  # one prompt type a column
    keys = sorted({k for r in rows for k in r})  # from_pylist takes the columns of the first row only
    for f, part in zip(files, (rows[:2], rows[2:])):
        pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in part]), f)
    for source in (rows, files):
        items = RLDataset(source, tok, max_prompt_length=64).items
        assert [tok.decode(it["prompt_ids"], skip_special_tokens=False) for it in items] == \
            [templated, templated, "12+3=", "12+3="]
        assert [it["ground_truth"] for it in items] == ["15", None, None, "15"]
        assert [it["data_source"] for it in items] == ["synthetic/addition", "python", "python", "python"]
        extras = [{k: v for k, v in it["extra_info"].items() if v is not None} for it in items]
        assert extras == [{"split": "train"}, {"answer": "15"}, {"answer": "15", "difficulty": 2}, {}]
