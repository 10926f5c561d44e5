"""The fault matrix, bad input: every bad configuration and bad data file below is rejected before
anything starts, with exit code 2 and one line naming the key (or file/row) and the fix, no
traceback, and no Ray (no process left behind either).

Most cases run through the CLI entry ``main(argv)`` in this process (cheap: no Ray, no workers);
a few go through the real ``python -m verl_lite.trainer.main_ppo`` in a subprocess, with every
process of it tagged by a marker, to prove the same holds end to end."""

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import psutil
import pytest
import ray

from tests.faults.conftest import CliRun, bad_files, tiny_assets, tiny_overrides  # noqa: F401

A = "actor_rollout_ref.actor"
R = "actor_rollout_ref.rollout"
M = "actor_rollout_ref.actor.megatron"


def _vocab_model(assets, files, kind: str) -> str:
    """A tiny model dir whose vocabulary disagrees (built once, next to the other broken files):
    ``weights_beyond_config``: config.json says vocab_size 100, the weights have 104 rows;
    ``small_vocab``: a consistent 64-token model carrying the 103-token char tokenizer;
    ``corrupt_weights``: model.safetensors starts with 4 KiB of 0xFF (no readable header)."""
    from verl_lite.data import save_char_tokenizer
    from verl_lite.utils import make_tiny_hf_model

    out = Path(files["a_file"]).parent / kind
    if not out.exists():
        if kind == "weights_beyond_config":
            shutil.copytree(assets["model"], out)
            cfg = json.loads((out / "config.json").read_text())
            cfg["vocab_size"] = 100
            (out / "config.json").write_text(json.dumps(cfg))
        elif kind == "corrupt_weights":
            shutil.copytree(assets["model"], out)
            with open(out / "model.safetensors", "r+b") as fh:
                fh.write(b"\xff" * 4096)
        else:
            with contextlib.redirect_stderr(io.StringIO()):  # save_pretrained's progress bar: not the run's stderr
                make_tiny_hf_model(out, vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, seed=0)
            save_char_tokenizer(out)
    return str(out)


# (id, overrides (dict merged over the tiny run, or a callable(assets, files) -> dict), key regex, fix regex)
CASES = [
    # ---- keys and values the schema rejects
    ("typo_key", {f"{A}.ppo_mini_bach_size": 2}, r"unknown config key '[^']*ppo_mini_bach_size'", r"did you mean '[^']*ppo_mini_batch_size'"),
    ("added_key", {"+trainer.learning_rate": 1}, r"trainer\.learning_rate", r"did you mean|see docs/config\.md"),
    ("wrong_type", {"data.train_batch_size": "many"}, r"data\.train_batch_size=many: expects an integer", r"e\.g\. data\.train_batch_size=\d+$"),
    ("wrong_type_list", {f"{A}.optim.betas": 3}, r"optim\.betas=3: expects a list", r"e\.g\. .*optim\.betas=\[0\.9,0\.\d+\]$"),
    ("unknown_section", {"critc.optim.lr": 1e-5}, r"unknown config key 'critc\.optim\.lr'", r"did you mean 'critic\.optim\.lr'"),
    ("unparsable", {"data.train_batch_size": "[1,"}, r"data\.train_batch_size|could not parse", r"parse|mismatched|no viable|extraneous"),
    # ---- sizes and layout
    ("zero_batch", {"data.train_batch_size": 0}, r"data\.train_batch_size=0", r"must be >= 1"),
    ("zero_n", {f"{R}.n": 0}, rf"{R}\.n=0", r"must be >= 1"),
    ("mini_not_dividing", {f"{A}.ppo_mini_batch_size": 3}, rf"{A}\.ppo_mini_batch_size=3", r"must divide data\.train_batch_size"),
    ("workers_vs_tp", {"trainer.n_gpus_per_node": 3, f"{M}.tensor_model_parallel_size": 2}, r"3 workers", r"must divide by tp\*pp\*cp"),
    ("vpp_without_pp", {f"{M}.virtual_pipeline_model_parallel_size": 2}, r"virtual_pipeline_model_parallel_size=2", r"needs pipeline_model_parallel_size > 1"),
    ("sp_without_tp", {f"{M}.sequence_parallel": "true"}, r"sequence_parallel=true", r"set it to false"),
    ("zero_pg_timeout", {f"{M}.timeout_s": 0}, r"megatron\.timeout_s=0", r"must be > 0"),
    ("tp_vs_heads", {"trainer.n_gpus_per_node": 3, f"{M}.tensor_model_parallel_size": 3, f"{A}.ppo_mini_batch_size": 4},
     r"tensor_model_parallel_size=3", r"must divide the model's attention heads"),
    ("layers_vs_pp", {"trainer.n_gpus_per_node": 4, f"{M}.pipeline_model_parallel_size": 4}, r"2 layers", r"must divide by pp x vpp"),
    ("no_micro_batch", {f"{A}.ppo_micro_batch_size_per_gpu": "null"}, rf"{A}", r"set ppo_micro_batch_size_per_gpu"),
    ("token_budget_too_small", {f"{A}.use_dynamic_bsz": "true", f"{A}.ppo_max_token_len_per_gpu": 4},
     r"ppo_max_token_len_per_gpu=4", r"raise it to at least"),
    ("zero_epochs", {f"{A}.ppo_epochs": 0}, rf"{A}\.ppo_epochs=0", r"must be >= 1"),
    # a local Ray is one node: it was an "internal error" after Ray and the workers had started
    ("nnodes_without_cluster", {"trainer.nnodes": 2}, r"trainer\.nnodes=2 needs a Ray cluster of 2 nodes",
     r"set RAY_ADDRESS to the head .* or use trainer\.nnodes=1$"),
    # ---- algorithm
    ("unknown_agg", {f"{A}.loss_agg_mode": "mean"}, r"loss_agg_mode='mean'", r"choose one of"),
    ("unknown_loss", {f"{A}.policy_loss.loss_mode": "ppo2"}, r"loss_mode='ppo2'", r"choose one of"),
    ("unknown_estimator", {"algorithm.adv_estimator": "grpo2"}, r"adv_estimator='grpo2'", r"choose one of"),
    ("grpo_one_sample", {f"{R}.n": 1, f"{A}.ppo_mini_batch_size": 2}, r"adv_estimator='grpo'", rf"set {R}\.n >= 2"),
    ("unknown_kl_type", {f"{A}.use_kl_loss": "true", f"{A}.kl_loss_type": "l3"}, r"kl_loss_type='l3'", r"choose one of"),
    ("unknown_kl_ctrl", {"algorithm.kl_ctrl.type": "pid"}, r"kl_ctrl\.type='pid'", r"choose one of"),
    ("adaptive_kl_horizon_0", {"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl.type": "adaptive",
                               "algorithm.kl_ctrl.horizon": 0}, r"kl_ctrl\.horizon=0", r"must be > 0"),
    ("negative_kl_loss_coef", {f"{A}.use_kl_loss": True, f"{A}.kl_loss_coef": -0.5}, r"kl_loss_coef=-0\.5",
     r"must be >= 0"),
    ("zero_clip", {f"{A}.clip_ratio": 0}, r"clip_ratio=0", r"must be > 0"),
    ("dual_clip_c", {f"{A}.clip_ratio_c": 1}, r"clip_ratio_c=1", r"must be > 1"),
    ("gamma_out_of_range", {"algorithm.gamma": 2}, r"algorithm\.gamma=2", r"must lie in \[0, 1\]"),
    # ---- optimizer
    ("zero_lr", {f"{A}.optim.lr": 0}, r"optim\.lr=0", r"must be > 0"),
    ("unknown_decay", {f"{A}.optim.lr_decay_style": "step"}, r"lr_decay_style='step'", r"choose constant, linear or cosine"),
    ("one_beta", {f"{A}.optim.betas": "[0.9]"}, r"optim\.betas=\[0\.9\]", r"must be two numbers"),
    ("zero_clip_grad", {f"{A}.optim.clip_grad": 0}, r"clip_grad=0", r"must be > 0"),
    # ---- rollout
    ("unknown_rollout", {f"{R}.name": "sglang"}, r"rollout\.name='sglang'", r"choose one of"),
    ("zero_temperature", {f"{R}.temperature": 0}, r"rollout\.temperature=0", r"must be > 0"),
    ("zero_top_p", {f"{R}.top_p": 0}, r"rollout\.top_p=0", r"must lie in \(0, 1\]"),
    ("greedy_val_n", {f"{R}.val_kwargs.n": 2}, r"val_kwargs\.n=2", r"needs val_kwargs\.do_sample=true"),
    # ---- data and model paths
    ("unknown_truncation", {"data.truncation": "middle"}, r"data\.truncation='middle'", r"choose one of"),
    ("missing_train_file", {"data.train_files": "/nonexistent/train.parquet"}, r"data\.train_files: '/nonexistent/train\.parquet'", r"give an existing parquet file"),
    ("missing_model", {"actor_rollout_ref.model.path": "/nonexistent/model"}, r"model\.path='/nonexistent/model'", r"give a local HF model dir"),
    ("broken_model_json", lambda a, f: {"actor_rollout_ref.model.path": f["broken_model"]}, r"model\.path=.*config\.json is not valid JSON", r"fix the file or re-export"),
    ("model_json_lacks_fields", lambda a, f: {"actor_rollout_ref.model.path": f["partial_model"]}, r"model\.path=.*lacks \['num_hidden_layers'\]", r"give a complete HF"),
    ("weights_beyond_vocab_size", lambda a, f: {"actor_rollout_ref.model.path": _vocab_model(a, f, "weights_beyond_config")},
     r"model\.path=.*model\.safetensors holds model\.embed_tokens\.weight of shape \[104, 32\] but config\.json's vocab_size is 100",
     r"set vocab_size to 104 in .*weights_beyond_config/config\.json"),
    ("tokenizer_beyond_vocab", lambda a, f: {"actor_rollout_ref.model.path": _vocab_model(a, f, "small_vocab")},
     r"model\.path=.*small_vocab': the tokenizer produces ids up to 102 \(103 tokens\) but the model's config\.json has vocab_size 64",
     r"ids >= 64 have no embedding row; give the tokenizer the model was trained with .* or a model with at least 103 vocabulary rows"),
    ("corrupt_weights", lambda a, f: {"actor_rollout_ref.model.path": _vocab_model(a, f, "corrupt_weights")},
     r"model\.path=.*corrupt_weights/model\.safetensors cannot be read as safetensors", r"re-export the model"),
    ("response_beyond_positions", lambda a, f: {"actor_rollout_ref.model.path": f["short_context_model"], "data.max_response_length": 12},
     r"data\.max_response_length=12 \+ the longest prompt", r"set data\.max_response_length <= \d+"),
    # ---- data files
    ("missing_column", lambda a, f: {"data.train_files": f["no_column"]}, r"no_column\.parquet: missing column\(s\) \['prompt'\]", r"set data\.prompt_key"),
    ("corrupt_parquet", lambda a, f: {"data.train_files": f["corrupt"]}, r"corrupt\.parquet: cannot be read as parquet", r"cannot be read"),
    ("empty_parquet", lambda a, f: {"data.val_files": f["empty_file"]}, r"empty\.parquet: cannot be read as parquet", r"cannot be read"),
    ("blank_string_prompt", lambda a, f: {"data.train_files": f["string_prompt"]}, r"string_prompt\.parquet row 0: 'prompt' is empty", r"give the prompt text or drop the row"),
    ("no_ground_truth", lambda a, f: {"data.train_files": f["no_truth"], "reward.custom_reward_function.path": "null"}, r"data\.train_files: 1 row\(s\) have no ground truth \(first: .*no_truth\.parquet row 0\) and the reward verl_lite\.reward\.default_compute_score needs one", r"give each row 'reward_model': \{'ground_truth': \.\.\.\} or a 'ground_truth' column"),
    ("empty_prompt", lambda a, f: {"data.val_files": f["empty_prompt"]}, r"empty_prompt\.parquet row 1: every message .* empty content", r"give the prompt text or drop the row"),
    ("bad_message", lambda a, f: {"data.train_files": f["bad_message"]}, r"bad_message\.parquet row 0: message 0", r"must be \{'role': str, 'content': str\}"),
    ("bad_data_source", lambda a, f: {"data.train_files": f["bad_source"]}, r"bad_source\.parquet row 0: 'data_source'", r"must be a string"),
    ("reward_fn_key_names_no_column", {"data.reward_fn_key": "nonexistent_col"}, r"no 'nonexistent_col' column",
     r"set data\.reward_fn_key to a column"),
    ("no_prompts_left", {"data.filter_overlong_prompts": "true", "data.max_prompt_length": 2}, r"no prompts left", r"raise data\.max_prompt_length"),
    ("overlong_prompt_error", {"data.filter_overlong_prompts": "false", "data.max_prompt_length": 5}, r"row 0: prompt has \d+ tokens > data\.max_prompt_length=5", r"raise max_prompt_length, set data\.filter_overlong_prompts=true"),
    ("batch_beyond_dataset", {"data.train_batch_size": 128, f"{A}.ppo_mini_batch_size": 2}, r"data\.train_batch_size=128 exceeds the 64 prompts", r"set data\.train_batch_size <= 64"),
    # ---- reward
    ("unknown_manager", {"reward.reward_manager": "parallel"}, r"reward_manager='parallel'", r"choose one of"),
    ("missing_reward_file", {"reward.custom_reward_function.path": "/nonexistent/r.py"}, r"custom_reward_function\.path='/nonexistent/r\.py' does not exist", r"give the path of a python file"),
    ("reward_name_missing", lambda a, f: {"reward.custom_reward_function.path": f["reward_other_name"]}, r"custom_reward_function\.name='compute_score'", r"set reward\.custom_reward_function\.name to one of \['my_score'\]"),
    ("reward_not_callable", lambda a, f: {"reward.custom_reward_function.path": f["reward_not_callable"]},
     r"custom_reward_function\.name='compute_score': .* binds 'compute_score' to a value of type int, not a function",
     r"set reward\.custom_reward_function\.name to a function"),
    ("reward_name_without_path", {"reward.custom_reward_function.path": "null",
                                  "reward.custom_reward_function.name": "my_scorer"},
     r"custom_reward_function\.name='my_scorer' names a function, but .*\.path is null", r"give \.path"),
    ("reward_path_is_a_directory", lambda a, f: {"reward.custom_reward_function.path": f["a_dir"]},
     r"custom_reward_function\.path='.*shards' is a directory", r"give the path of a python file in it"),
    ("train_files_is_a_directory", lambda a, f: {"data.train_files": f["a_dir"]},
     r"data\.train_files: '.*shards' is a directory", r"list its parquet files"),
    ("train_files_is_jsonl", lambda a, f: {"data.train_files": f["jsonl"]}, r"rows\.jsonl: cannot be read as parquet",
     r"convert it: pandas\.read_json\(f, lines=True\)\.to_parquet"),
    ("reward_syntax_error", lambda a, f: {"reward.custom_reward_function.path": f["reward_syntax_error"]}, r"reward_syntax_error\.py' does not parse", r"fix the file"),
    ("reward_import_error", lambda a, f: {"reward.custom_reward_function.path": f["reward_import_error"]}, r"reward_import_error\.py' fails to import \(ModuleNotFoundError", r"fix the file"),
    ("reward_raises_at_import", lambda a, f: {"reward.custom_reward_function.path": f["reward_raises_at_import"]}, r"fails to import \(RuntimeError: the grader needs a licence server\)", r"fix the file"),
    ("reward_kwargs_unknown", lambda a, f: {"reward.custom_reward_function.path": f["reward_no_kwargs"], "+reward.custom_reward_function.reward_kwargs.alpha": 2},
     r"reward_kwargs=\{'alpha': 2\} do not fit the reward function .*reward_no_kwargs\.py:compute_score", r"unexpected keyword argument 'alpha'.*remove the extra keys"),
    ("reward_signature_positional", lambda a, f: {"reward.custom_reward_function.path": f["reward_positional"]}, r"do not fit the reward function .*reward_positional\.py", r"add the missing parameters"),
    ("zero_reward_timeout", {"reward.timeout_s": 0}, r"reward\.timeout_s=0", r"must be > 0"),
    # ---- trainer / output
    ("zero_worker_timeout", {"trainer.worker_timeout_s": 0}, r"worker_timeout_s=0", r"must be > 0"),
    ("unknown_logger", {"trainer.logger": "[stdout]"}, r"trainer\.logger entry 'stdout'", r"choose"),
    ("output_dir_under_a_file", lambda a, f: {"trainer.output_dir": f["a_file"] + "/runs"}, r"trainer\.output_dir=.*a_file/runs.*cannot create", r"set trainer\.output_dir to a directory you can write"),
    ("output_dir_in_proc", {"trainer.output_dir": "/proc/verl_lite_runs"}, r"trainer\.output_dir='/proc/verl_lite_runs': cannot create", r"set trainer\.output_dir to a directory you can write"),
]
RECIPE_CASES = [
    ("missing_recipe", lambda f: ["--recipe", "/nonexistent/recipe.yaml"], r"--recipe /nonexistent/recipe\.yaml", r"no such file"),
    ("bad_value_in_recipe", lambda f: ["--recipe", f["recipe_bad"]], r"data\.train_batch_size=-3", r"must be >= 1"),
]
SUBPROCESS_CASES = ["typo_key", "corrupt_parquet", "broken_model_json", "weights_beyond_vocab_size", "reward_kwargs_unknown",
                    "output_dir_under_a_file"]


def _args(case, assets, files, tmp_path) -> list[str]:
    extra = case[1](assets, files) if callable(case[1]) else dict(case[1])
    extra.setdefault("trainer.output_dir", str(tmp_path / "out"))
    return tiny_overrides(assets, **extra)


def _check_block(err: str, key: str, fix: str) -> None:
    assert "Traceback" not in err, err
    assert err.startswith("verl_lite: "), err
    lines = err.splitlines()
    hits = [ln for ln in lines if re.search(key, ln) and re.search(fix, ln)]
    assert hits, f"no single line names the key /{key}/ and the fix /{fix}/:\n{err}"
    assert "(full traceback: --debug or VERL_LITE_DEBUG=1" in lines[-1], err


def test_matrix_is_large_enough():
    assert len(CASES) + len(RECIPE_CASES) >= 40
    assert len({c[0] for c in CASES + RECIPE_CASES}) == len(CASES) + len(RECIPE_CASES)


@pytest.mark.parametrize("case", CASES + RECIPE_CASES, ids=[c[0] for c in CASES + RECIPE_CASES])
def test_bad_input_is_rejected_before_start(case, tiny_assets, bad_files, tmp_path, capsys):  # noqa: F811
    from verl_lite.trainer import main_ppo

    if ray.is_initialized():
        ray.shutdown()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    if case in RECIPE_CASES:
        argv = tiny_overrides(tiny_assets, **{"trainer.output_dir": str(tmp_path / "out")}) + case[1](bad_files)
    else:
        argv = _args(case, tiny_assets, bad_files, tmp_path)
    code = main_ppo.main(argv)
    err = capsys.readouterr().err
    assert code == 2, f"exit {code}:\n{err}"
    _check_block(err, case[2], case[3])
    assert not ray.is_initialized(), "Ray was started for a bad input"
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.status() != "zombie"]
    assert left == [], f"processes left: {left}"
    assert not (tmp_path / "out").exists() or case[0].startswith("output_dir"), "a rejected run wrote an output dir"


def test_every_problem_is_reported_in_one_run(tiny_assets, bad_files, tmp_path, capsys):  # noqa: F811
    """A wrong type, an unknown key, a layout rule, a missing data file and a missing reward file: one block."""
    from verl_lite.trainer import main_ppo

    cases = ["wrong_type", "typo_key", "mini_not_dividing", "missing_train_file", "missing_reward_file"]
    extra = {k: v for name in cases for k, v in next(c for c in CASES if c[0] == name)[1].items()}
    code = main_ppo.main(tiny_overrides(tiny_assets, **extra, **{"trainer.output_dir": str(tmp_path / "out")}))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"verl_lite: invalid config ({len(cases)} problem(s)):"), err
    for name in cases:
        _, _, key, fix = next(c for c in CASES if c[0] == name)
        assert [ln for ln in err.splitlines() if re.search(key, ln) and re.search(fix, ln)], f"{name} missing:\n{err}"


@pytest.fixture(scope="module")
def cli_runs(tiny_assets, bad_files, tmp_path_factory):  # noqa: F811
    """The SUBPROCESS_CASES' CLI runs, three at a time (each is one Python start-up that stops at
    pre-flight: mostly one core's import work, so two cores take about two at once); name -> CliRun."""
    from concurrent.futures import ThreadPoolExecutor

    def launch(name):
        try:
            case = next(c for c in CASES if c[0] == name)
            run = CliRun(_args(case, tiny_assets, bad_files, tmp_path_factory.mktemp(name))).wait(timeout=600)
            run.left = run.leftover(settle_s=2.0)  # as soon as it exited, as a run of its own is checked
            return run
        except BaseException as err:  # noqa: BLE001 - reported by that case's test
            return err

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip(SUBPROCESS_CASES, pool.map(launch, SUBPROCESS_CASES)))


@pytest.mark.parametrize("name", SUBPROCESS_CASES)
def test_bad_input_through_the_real_cli(name, cli_runs):
    case = next(c for c in CASES if c[0] == name)
    run = cli_runs[name]
    if isinstance(run, BaseException):
        raise run
    assert run.code == 2, f"exit {run.code}:\n{run.err}"
    _check_block(run.err, case[2], case[3])
    # refused at pre-flight: no worker, no Ray (the check on ``others`` below); how fast is a benchmark's question
    assert run.left == []
    own = run.cmdlines.get(run.proc.pid)  # a child seen only between fork and exec shows the CLI's own command
    others = {pid: cmd for pid, cmd in run.cmdlines.items()
              if pid != run.proc.pid and cmd != own and "sandbox_child.py" not in cmd}
    assert others == {}, f"processes other than the reward process were started: {others}"
