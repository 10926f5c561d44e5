"""Config: defaults, overrides, unknown-key rejection, pre-flight validation."""

from pathlib import Path

import pytest

from verl_lite.config import (
    CONFIG_DIR,
    ConfigError,
    PPOConfig,
    config_to_dict,
    default_model_path,
    load_config,
    schema_keys,
    validate_config,
)

A = "actor_rollout_ref.actor"
M = "actor_rollout_ref.actor.megatron"


def test_defaults_load_and_fill_builtin_paths():
    cfg = load_config([])
    assert isinstance(cfg, PPOConfig)
    assert cfg.actor_rollout_ref.model.path == default_model_path()
    assert cfg.actor_rollout_ref.model.tokenizer_path == default_model_path()
    assert isinstance(cfg.data.train_files, list) and cfg.data.train_files[0].endswith("train.parquet")
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.name == "hf"
    d = config_to_dict(cfg)
    assert d["data"]["train_batch_size"] == cfg.data.train_batch_size


def test_overrides_apply_with_types():
    cfg = load_config([
        "data.train_batch_size=8", f"{A}.optim.lr=3e-4", f"{A}.megatron.virtual_pipeline_model_parallel_size=2",
        "data.train_files=/x/a.parquet", "data.val_files=[/x/b.parquet,/x/c.parquet]", "trainer.logger=[console]",
        "reward.custom_reward_function.reward_kwargs.alpha=2", "+reward.custom_reward_function.reward_kwargs.beta=x",
        f"+{A}.ppo_epochs=3",  # '+' on an existing key is a plain override
    ])
    assert cfg.data.train_batch_size == 8 and cfg.actor_rollout_ref.actor.optim.lr == 3e-4
    assert cfg.actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size == 2
    assert cfg.data.train_files == ["/x/a.parquet"] and cfg.data.val_files == ["/x/b.parquet", "/x/c.parquet"]
    assert cfg.trainer.logger == ["console"]
    assert cfg.reward.custom_reward_function.reward_kwargs == {"alpha": 2, "beta": "x"}
    assert cfg.actor_rollout_ref.actor.ppo_epochs == 3


@pytest.mark.parametrize(
    "override,suggest",
    [
        ("data.train_batchsize=3", "data.train_batch_size"),
        ("+data.train_batchsize=3", "data.train_batch_size"),
        (f"+{A}.ppo_epoch=2", f"{A}.ppo_epochs"),
        (f"{A}.optim.learning_rate=1", None),  # nothing close in optim (min_lr is not a spelling of it)
        ("actor.ppo_epochs=2", f"{A}.ppo_epochs"),  # a valid key without its prefix
        ("+totally_new=1", None),
        ("trainer.total_epoch=3", "trainer.total_epochs"),
        ("actor_rollout_ref.rollout.temprature=0.5", "actor_rollout_ref.rollout.temperature"),
        ("data.ppo_epochs=2", None),  # ppo_epochs lives in another section: no hint
        ("trainer.zzz=1", None),
    ],
)
def test_unknown_keys_rejected_with_suggestion(override, suggest):
    key = override.lstrip("+").split("=")[0]
    with pytest.raises(ConfigError) as info:
        load_config([override])
    msg = str(info.value)
    assert f"unknown config key '{key}'" in msg
    if suggest:
        assert f"did you mean '{suggest}'" in msg
    else:
        assert "did you mean" not in msg


def test_wrong_type_names_key():
    with pytest.raises(ConfigError, match="data.train_batch_size"):
        load_config(["data.train_batch_size=many"])


def test_schema_keys_cover_brief():
    keys = schema_keys()
    for k in ["data.filter_overlong_prompts", f"{A}.policy_loss.loss_mode", f"{M}.calculate_per_token_loss",
              "actor_rollout_ref.rollout.val_kwargs.top_k", "algorithm.kl_ctrl.horizon",
              "reward.custom_reward_function.reward_kwargs", "trainer.worker_timeout_s",
              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"]:
        assert k in keys, k


# ---------------------------------------------------------------- validation


def _problems(overrides, world_size=None):
    cfg = load_config(overrides)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, world_size=world_size)
    return info.value.problems


def test_default_config_is_valid_and_layout():
    if not Path(default_model_path(), "config.json").is_file():
        pytest.skip("shipped model not built yet (scripts/make_tiny_model.py)")
    cfg = load_config([])
    lay = validate_config(cfg)
    assert lay.dp == 1 and lay.trajectories_per_step == cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    lay = validate_config(load_config(["trainer.n_gpus_per_node=4", f"{M}.tensor_model_parallel_size=2"]))
    assert lay.world_size == 4 and lay.dp == 2
    assert lay.trajectories_per_dp_rank == lay.trajectories_per_mini_batch // 2


@pytest.mark.parametrize(
    "overrides,world,key,fix",
    [
        (["data.train_batch_size=32", f"{A}.ppo_mini_batch_size=5"], None, f"{A}.ppo_mini_batch_size=5",
         "must divide data.train_batch_size=32"),
        ([f"{M}.tensor_model_parallel_size=3"], 4, "tp*pp*cp", "change actor_rollout_ref.actor.megatron"),
        (["data.train_batch_size=3", f"{A}.ppo_mini_batch_size=3", "actor_rollout_ref.rollout.n=3"], 2,
         "trajectories per mini-batch", "must divide by DP = 2"),
        (["trainer.resume_mode=latest"], None, "trainer.resume_mode='latest'", "choose one of"),
        (["trainer.resume_mode=resume_path"], None, "trainer.resume_mode=resume_path", "trainer.resume_from_path="),
        (["trainer.worker_timeout_s=0"], None, "trainer.worker_timeout_s=0", "must be > 0"),
        ([f"{A}.loss_agg_mode=token_mean"], None, f"{A}.loss_agg_mode='token_mean'", "choose one of"),
        ([f"{A}.policy_loss.loss_mode=ppo"], None, f"{A}.policy_loss.loss_mode='ppo'", "choose one of"),
        (["algorithm.adv_estimator=grpoo"], None, "algorithm.adv_estimator='grpoo'", "choose one of"),
        (["algorithm.adv_estimator=gae", "critic.megatron.tensor_model_parallel_size=3"], 4, "critic's 4 workers",
         "change critic.megatron"),
        (["algorithm.adv_estimator=gae", "critic.cliprange_value=-1"], None, "critic.cliprange_value=-1", ">= 0"),
        (["trainer.critic_warmup=2"], None, "trainer.critic_warmup=2 needs a critic", "adv_estimator=gae"),
        (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0"], None,
         "max_num_gen_batches=0", "must be >= 1"),
        (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=foo"], None,
         "filter_groups.metric='foo'", "choose one of"),
        (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=99"], None, "overlong_buffer.len=99",
         "must lie in (0, data.max_response_length"),
        ([f"{A}.policy_loss.clip_cov_lb=6"], None, "clip_cov_lb=6.0", "must be < clip_cov_ub"),
        (["actor_rollout_ref.rollout.n=1"], None, "actor_rollout_ref.rollout.n >= 2", "compares samples"),
        ([f"{M}.virtual_pipeline_model_parallel_size=2"], None, "virtual_pipeline_model_parallel_size=2",
         "needs pipeline_model_parallel_size > 1"),
        ([f"{M}.pipeline_model_parallel_size=3", "trainer.n_gpus_per_node=3"], None, "layers must divide by pp x vpp",
         "pipeline_model_parallel_size"),
        ([f"{A}.use_dynamic_bsz=true", f"{A}.ppo_max_token_len_per_gpu=4"], None, f"{A}.ppo_max_token_len_per_gpu=4",
         "raise it to at least"),
        ([f"{A}.ppo_micro_batch_size_per_gpu=null"], None, f"{A}: set ppo_micro_batch_size_per_gpu", "use_dynamic_bsz"),
        (["reward.custom_reward_function.path=/nonexistent/r.py"], None, "reward.custom_reward_function.path",
         "give the path of a python file"),
        (["actor_rollout_ref.model.path=/nonexistent/model"], None, "actor_rollout_ref.model.path", "HF model dir"),
        (["data.train_files=/nonexistent/t.parquet"], None, "data.train_files", "does not exist"),
        (["reward.reward_manager=fast"], None, "reward.reward_manager='fast'", "naive"),
        (["actor_rollout_ref.rollout.name=sglang"], None, "actor_rollout_ref.rollout.name='sglang'", "hf"),
        (["actor_rollout_ref.rollout.temperature=0"], None, "actor_rollout_ref.rollout.temperature=0", "> 0"),
        ([f"{M}.sequence_parallel=true"], None, f"{M}.sequence_parallel=true", "set it to false"),
        ([f"{A}.clip_ratio_c=0.5"], None, f"{A}.clip_ratio_c=0.5", "> 1"),
        (["trainer.logger=[console,mlflow]"], None, "trainer.logger entry 'mlflow'", "choose from"),
        (["trainer.log_freq=0"], None, "trainer.log_freq=0", "must be >= 1"),
        (["trainer.max_actor_ckpt_to_keep=0"], None, "trainer.max_actor_ckpt_to_keep=0", "must be >= 1"),
    ],
)
def test_each_validation_error_names_key_and_fix(overrides, world, key, fix):
    problems = _problems(overrides, world)
    hit = [p for p in problems if key in p]
    assert hit, problems
    assert any(fix in p for p in hit), hit


def test_all_problems_collected_at_once():
    problems = _problems([f"{A}.ppo_mini_batch_size=5", f"{A}.loss_agg_mode=x", "reward.reward_manager=y"])
    assert len([p for p in problems if "ppo_mini_batch_size" in p or "loss_agg_mode" in p
                or "reward_manager" in p]) == 3


def test_reward_function_name_checked(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    problems = _problems([f"reward.custom_reward_function.path={f}"])
    assert any("reward.custom_reward_function.name='compute_score'" in p and "my_score" in p for p in problems)
    cfg = load_config([f"reward.custom_reward_function.path={f}", "reward.custom_reward_function.name=my_score"])
    try:
        validate_config(cfg)
    except ConfigError as e:  # only unrelated problems (e.g. missing shipped assets) may remain
        assert not any("reward" in p for p in e.problems)


def test_docs_list_every_key():
    doc = (Path(CONFIG_DIR).parent.parent / "docs" / "config.md").read_text()
    for key, kind in schema_keys().items():
        if kind != "section":
            assert f"`{key.rsplit('.', 1)[-1]}" in doc or f".{key.rsplit('.', 1)[-1]}`" in doc, key
    design_vocab = [
        "- `data.train_batch_size`: prompts per RL step. Trajectories per step = prompts x `rollout.n`.",
        "- `actor.ppo_mini_batch_size`: prompts per optimizer step (x n trajectories). Must divide the\n"
        "  step's prompts; the trajectories must divide by DP.",
    ]
    for line in design_vocab:
        assert line in doc


HYDRA_MAIN = '''
import hydra
from verl_lite.config import CONFIG_DIR, register_configs, config_from_hydra
register_configs()
@hydra.main(config_path=CONFIG_DIR, config_name="ppo_trainer", version_base=None)
def main(dict_cfg):
    cfg = config_from_hydra(dict_cfg)
    print("TBS", cfg.data.train_batch_size, cfg.actor_rollout_ref.model.path is not None)
main()
'''


def test_hydra_main_entry(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "entry.py"
    script.write_text(HYDRA_MAIN)
    ok = subprocess.run([sys.executable, str(script), "data.train_batch_size=8", f"hydra.run.dir={tmp_path}/o"],
                        capture_output=True, text=True, timeout=120)
    assert "TBS 8 True" in ok.stdout, ok.stderr[-2000:]
    bad = subprocess.run([sys.executable, str(script), "+data.train_batchsize=8", f"hydra.run.dir={tmp_path}/o"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0
    assert "unknown config key 'data.train_batchsize'; did you mean 'data.train_batch_size'" in bad.stdout + bad.stderr


def test_one_bad_value_is_one_line_at_the_key_the_user_set():
    """Keys that hold another key's value (null = that key's, ``loader.INHERITED``) fail with it; only the key
    that was set is reported. A copy set to a bad value of its own is still reported."""
    from verl_lite.config import ConfigError, load_config, validate_config

    A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    for overrides, only in ((["data.max_response_length=0"], "data.max_response_length=0 must be >= 1"),
                            ([f"{A}.ppo_micro_batch_size_per_gpu=0"], f"{A}.ppo_micro_batch_size_per_gpu=0 must be >= 1")):
        with pytest.raises(ConfigError) as err:
            validate_config(load_config(overrides))
        assert err.value.problems == [only], err.value.problems
    with pytest.raises(ConfigError) as err:
        validate_config(load_config([f"{A}.ppo_micro_batch_size_per_gpu=0", f"{R}.log_prob_micro_batch_size_per_gpu=-1"]))
    assert [line.split("=")[0] for line in err.value.problems] == [f"{A}.ppo_micro_batch_size_per_gpu",
                                                                  f"{R}.log_prob_micro_batch_size_per_gpu"]


def test_one_name_for_a_list_of_names_is_a_list_of_one():
    """verl's trackers take ``trainer.logger=console`` as ``[console]``; so does the loader, for every list-of-names
    key. A value of the wrong kind is still refused (a word for Adam's betas)."""
    from verl_lite.config import ConfigError, load_config

    assert load_config(["trainer.logger=console"]).trainer.logger == ["console"]
    lora = load_config(["actor_rollout_ref.model.lora.exclude_modules=lm_head"]).actor_rollout_ref.model.lora
    assert lora.exclude_modules == ["lm_head"]
    with pytest.raises(ConfigError, match=r"optim\.betas=high: expects a list"):
        load_config(["actor_rollout_ref.actor.optim.betas=high"])


@pytest.mark.parametrize("overrides,expected", [
    (["trainer.n_gpus_per_node=2", f"{M}.tensor_model_parallel_size=2"], "TP = PP = CP = 1"),
    (["trainer.n_gpus_per_node=2", f"{M}.pipeline_model_parallel_size=2"], "TP = PP = CP = 1"),
    (["trainer.n_gpus_per_node=2", f"{M}.expert_model_parallel_size=2"], "all-to-all across the DP ranks"),
    (["actor_rollout_ref.rollout.dtype=bfloat16"], "set them equal"),
    (["actor_rollout_ref.hybrid_engine=false"], "split placement is not built with it"),
], ids=["tp2", "pp2", "ep2", "dtype", "split"])
def test_the_consistency_mode_refuses_what_it_cannot_honour(overrides, expected):
    problems = _problems(["actor_rollout_ref.rollout.batch_invariant=true", *overrides])
    assert any(expected in p and "batch_invariant" in p for p in problems), problems


def test_rollout_tensor_parallelism_is_vllm_s_and_must_divide_the_heads():
    problems = _problems(["actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    assert any("only the vLLM rollout shards its model" in p for p in problems), problems
    problems = _problems(["actor_rollout_ref.rollout.tensor_model_parallel_size=3"])
    assert any("must divide the model's" in p and "attention heads" in p for p in problems), problems
