"""The policy's pre-flight checks, applied to its peers (issue 47): the reward model (discriminative and
generative judge) and a critic of its own get the same model-file rules as the policy (tokenizer ids within
the vocabulary, weights present and matching config.json); a LoRA adapter_path is checked before start;
rank 0 with adapter-only settings is refused; an engine whose estimated memory cannot fit is refused with
the numbers. Every case runs the CLI entry ``main(argv)`` in this process and must exit 2 before Ray or any
worker starts, with one line naming the key or file and the reason, and write nothing outside its tmp dirs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import psutil
import pytest
import ray

from tests.faults.conftest import tiny_assets, tiny_overrides  # noqa: F401

RM = "reward_model"
LORA = "actor_rollout_ref.model.lora"


def _save_rm(out: Path, vocab_size: int = 104) -> str:
    """A tiny one-logit Qwen2 sequence classifier (model.* + score.weight) with the char tokenizer (103 ids)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from verl_lite.data import save_char_tokenizer

    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128, num_labels=1,
                      pad_token_id=0)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(cfg).save_pretrained(out)
    save_char_tokenizer(out)
    return str(out)


def _edit_config(src: str, out: Path, **fields) -> str:
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(fields)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _without(src: str, out: Path, drop: str | None = None) -> str:
    """A copy of ``src`` without its weights file (``drop`` None), or whose weights lack the tensor ``drop``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    weights = out / "model.safetensors"
    if drop is None:
        weights.unlink()
    else:
        tensors = load_file(str(weights))
        del tensors[drop]
        save_file(tensors, str(weights))
    return str(out)


@pytest.fixture(scope="module")
def models(tiny_assets, tmp_path_factory):  # noqa: F811
    """The planted model directories, built once: a valid RM and its broken variants, a small-vocabulary
    causal LM (a judge), a critic dir without weights, PEFT adapter dirs."""
    from verl_lite.data import save_char_tokenizer
    from verl_lite.utils import make_tiny_hf_model

    root = tmp_path_factory.mktemp("peers")
    m = {"rm": _save_rm(root / "rm"), "rm_small_vocab": _save_rm(root / "rm_small_vocab", vocab_size=64)}
    m["rm_fewer_layers"] = _edit_config(m["rm"], root / "rm_fewer_layers", num_hidden_layers=1)
    m["rm_narrower"] = _edit_config(m["rm"], root / "rm_narrower", hidden_size=16)
    m["rm_no_weights"] = _without(m["rm"], root / "rm_no_weights")
    m["rm_no_score"] = _without(m["rm"], root / "rm_no_score", drop="score.weight")
    judge = make_tiny_hf_model(root / "judge_small_vocab", vocab_size=64, hidden_size=32, num_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, seed=0)
    save_char_tokenizer(judge)
    m["judge_small_vocab"] = str(judge)
    m["critic_no_weights"] = _without(tiny_assets["model"], root / "critic_no_weights")
    adapter = root / "adapter_r4"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 32.0, "target_modules": ["q_proj", "v_proj"]}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")  # present; its tensors are the loader's to read
    m["adapter_r4"] = str(adapter)
    m["missing"] = str(root / "no_such_adapter")
    return m


def _rm(path: str, **extra) -> dict:
    return {f"{RM}.enable": "true", f"{RM}.model.path": path, **extra}


JUDGE = {f"{RM}.generative": "true", f"{RM}.rollout.prompt_length": 64, f"{RM}.rollout.response_length": 16}
GAE = {"algorithm.adv_estimator": "gae"}

# (id, overrides from the planted dirs, regex of the one line: the key or file and the reason, and the fix)
CASES = [
    ("rm_tokenizer_beyond_vocab", lambda m: _rm(m["rm_small_vocab"]),
     r"^reward_model\.model\.path='.*rm_small_vocab': the tokenizer produces ids up to 102 \(103 tokens\) but the "
     r"model's config\.json has vocab_size 64: .* \(reward_model\.model\.tokenizer_path\), or a model with at "
     r"least 103"),
    ("judge_tokenizer_beyond_vocab", lambda m: {**_rm(m["judge_small_vocab"]), **JUDGE},
     r"^reward_model\.model\.path='.*judge_small_vocab': the tokenizer produces ids up to 102 .* vocab_size 64"),
    ("rm_config_fewer_layers_than_weights", lambda m: _rm(m["rm_fewer_layers"]),
     r"^reward_model\.model\.path='.*rm_fewer_layers': the weights hold 2 layers but .*rm_fewer_layers/config\.json "
     r"says num_hidden_layers=1: config\.json describes a smaller model than its weights; set num_hidden_layers=2"),
    ("rm_config_narrower_than_weights", lambda m: _rm(m["rm_narrower"]),
     r"^reward_model\.model\.path='.*rm_narrower': .*rm_narrower/model\.safetensors holds model\.layers\.0\.\S+ of "
     r"shape \[\d+(, \d+)?\] but .*config\.json \(\{'hidden_size': 16.*\) implies \[.*\(and \d+ more tensors differ\): "
     r"the weights do not match config\.json"),
    ("rm_without_weights", lambda m: _rm(m["rm_no_weights"]),
     r"^reward_model\.model\.path='.*rm_no_weights' holds no weights \(no \*\.safetensors next to its config\.json\); "
     r"save the model with save_pretrained"),
    ("rm_without_score_head", lambda m: _rm(m["rm_no_score"]),
     r"^reward_model\.model\.path='.*rm_no_score': the weights lack score\.weight \(the reward model's score head\)"),
    ("critic_without_weights", lambda m: {**GAE, "critic.model.path": m["critic_no_weights"]},
     r"^critic\.model\.path='.*critic_no_weights' holds no weights"),
    ("missing_adapter_path", lambda m: {f"{LORA}.rank": 8, f"{LORA}.adapter_path": m["missing"]},
     rf"^{LORA}\.adapter_path='.*no_such_adapter' does not exist or is not a directory; give a PEFT adapter directory"),
    ("critic_missing_adapter_path", lambda m: {**GAE, "critic.model.lora.rank": 8,
                                               "critic.model.lora.adapter_path": m["missing"]},
     r"^critic\.model\.lora\.adapter_path='.*no_such_adapter' does not exist"),
    ("adapter_settings_differ", lambda m: {f"{LORA}.rank": 8, f"{LORA}.adapter_path": m["adapter_r4"]},
     rf"^{LORA}\.adapter_path='.*adapter_r4': does not match the lora settings: rank 8 vs the adapter's r=4; .*target "
     rf"modules .* vs the adapter's \['q_proj', 'v_proj'\]; set {LORA}\.rank/alpha/target_modules to the adapter's"),
    ("rank0_with_target_modules", {f"{LORA}.target_modules": "[q_proj,v_proj]"},
     rf"^{LORA}\.rank=0 \(no LoRA: the full model trains\) with {LORA}\.target_modules=\['q_proj', 'v_proj'\] set: .*"
     rf"set {LORA}\.rank > 0 to train adapters, or drop {LORA}\.target_modules to train the full model"),
    ("rank0_with_adapter_path", lambda m: {f"{LORA}.adapter_path": m["adapter_r4"]},
     rf"^{LORA}\.rank=0 \(no LoRA.*\) with {LORA}\.adapter_path='.*adapter_r4' set: .*set {LORA}\.rank > 0"),
]


def _run(argv, capsys, tmp_path) -> str:
    """``main(argv)``: exit 2, nothing started (no Ray, no process), no output dir; returns stderr."""
    from verl_lite.trainer import main_ppo

    if ray.is_initialized():
        ray.shutdown()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    code = main_ppo.main(argv)
    err = capsys.readouterr().err
    assert code == 2, f"exit {code}:\n{err}"
    assert "Traceback" not in err and err.startswith("verl_lite: "), err
    assert not ray.is_initialized(), "Ray was started for a bad input"
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.status() != "zombie"]
    assert left == [], f"processes left: {left}"
    assert not (tmp_path / "out").exists(), "a refused run wrote its output directory"
    return err


def _argv(assets, tmp_path, extra: dict) -> list[str]:
    return tiny_overrides(assets, **{"trainer.output_dir": str(tmp_path / "out"), **extra})


def _one_line(err: str, pattern: str) -> str:
    lines = [ln.strip().lstrip("- ").strip() for ln in err.splitlines()]
    hits = [ln for ln in lines if re.search(pattern, ln)]
    assert hits, f"no line matches /{pattern}/:\n{err}"
    return hits[0]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_peer_gets_the_policys_checks_before_start(case, models, tiny_assets, tmp_path, capsys):  # noqa: F811
    _, extra, pattern = case
    extra = extra(models) if callable(extra) else extra
    _one_line(_run(_argv(tiny_assets, tmp_path, extra), capsys, tmp_path), pattern)


def test_the_planted_dirs_differ_from_a_valid_rm_only_where_planted(models, tiny_assets):  # noqa: F811
    """Control: the valid RM (and the default target_modules with rank 0) pass the same checks."""
    from verl_lite.config import load_config, validate_config
    from verl_lite.config.preflight import check_model_files, tokenizer_problems

    cfg = load_config(tiny_overrides(tiny_assets, **_rm(models["rm"]), **{f"{LORA}.rank": 0}))
    validate_config(cfg)
    check_model_files(cfg)
    assert tokenizer_problems(cfg, None) == []


def test_a_lora_rank_that_cannot_fit_is_refused_with_the_numbers(tiny_assets, tmp_path, capsys,  # noqa: F811
                                                                  monkeypatch):
    """Issue 47's case: rank 100000 on a hidden-128 model (the shipped tiny model) grew a worker to 19.7 GB
    before Ray's OOM killer; on a machine of the reviewer's size (16 GiB available, planted as the device)
    it is refused before start, naming the key, the estimate per part and the knob."""
    from verl_lite.engine import memory

    monkeypatch.setattr(memory, "device_memory", lambda: (16 * memory.GIB, "this machine's 16.0 GiB of available RAM"))
    argv = _argv(tiny_assets, tmp_path, {"actor_rollout_ref.model.path": "null", f"{LORA}.rank": 100000})
    line = _one_line(_run(argv, capsys, tmp_path), rf"^{LORA}\.rank=100000: ")
    total = float(re.search(r"need an estimated ([\d.]+) GiB in all", line).group(1))
    assert total > 16, line
    for part in ("LoRA factors 3.6", "gradients 3.6", "optimizer 7.2", "LoRA activations"):
        assert part in line, line
    assert "more than this machine's 16.0 GiB of available RAM" in line and f"lower {LORA}.rank" in line, line
    assert "run fewer worker processes on this machine" in line, line


def test_the_memory_refusal_counts_every_worker_process_of_the_machine(tiny_assets):  # noqa: F811
    """Four workers share one machine's RAM: four times one worker's estimate is what must fit."""
    import torch

    from verl_lite.config import load_config
    from verl_lite.config.preflight import memory_problems

    if torch.cuda.is_available():
        pytest.skip("on GPU each worker has a device of its own")

    def need(n: int) -> float:
        cfg = load_config([f"{LORA}.rank=20000", f"trainer.n_gpus_per_node={n}",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"])
        line = memory_problems(cfg, device=(1, "1 byte"))[0]
        return float(re.search(r"need an estimated ([\d.]+) GiB in all", line).group(1))

    assert need(4) == pytest.approx(4 * need(1), rel=0.05)
