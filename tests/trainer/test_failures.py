"""The run stops cleanly: a bad config before anything starts; a broken reward function with an
error naming the function and the sample, every worker killed and every Ray process gone."""

import time

import psutil
import pytest
import ray

from tests.e2e.conftest import tiny_assets, tiny_overrides  # noqa: F401  (fixture)

REWARDS = {
    # raises on the 6th sample of the first step
    "raise": ("naive", '''
_calls = [0]
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    _calls[0] += 1
    if _calls[0] == 6:
        raise ValueError("the grader crashed")
    return 0.5
''', r"reward function .*toy_reward_raise\.py:compute_score raised ValueError: the grader crashed on sample 5"),
    "nan": ("naive", '''
_calls = [0]
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    _calls[0] += 1
    return float("nan") if _calls[0] == 3 else 1.0
''', r"reward function .*toy_reward_nan\.py:compute_score on sample 2 .* non-finite score nan"),
    "count": ("batch", '''
def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
    return [1.0] * (len(solution_strs) - 1)
''', r"batched reward function .*toy_reward_count\.py:compute_score returned 15 scores for 16 samples"),
}


def _descendants():
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _still_alive(pids, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.5)
    return [(p, psutil.Process(p).name()) for p in alive]


@pytest.mark.parametrize("kind,workers", [("raise", 2), ("nan", 1), ("count", 1)])
def test_broken_reward_stops_the_run_and_leaves_no_process(tiny_assets, tmp_path, kind, workers):
    from verl_lite.config import load_config
    from verl_lite.reward import RewardError
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    if ray.is_initialized():
        ray.shutdown()
    manager, src, pattern = REWARDS[kind]
    path = tmp_path / f"toy_reward_{kind}.py"
    path.write_text(src)
    before = _descendants()
    cfg = load_config(tiny_overrides(tiny_assets, **{
        "reward.custom_reward_function.path": str(path), "reward.reward_manager": manager,
        "trainer.val_before_train": "false", "trainer.n_gpus_per_node": workers,
    }))
    trainer = PPOTrainer(cfg)
    with pytest.raises(RewardError, match=pattern):
        trainer.fit()
    assert trainer.actor is None and not ray.is_initialized(), "the trainer started Ray, so it must stop it"
    leftover = _still_alive(_descendants() - before)
    assert leftover == [], f"processes left behind: {leftover}"


def test_bad_config_is_rejected_before_any_worker_starts(tiny_assets):
    from verl_lite.config import ConfigError, load_config
    from verl_lite.trainer import main_ppo
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    if ray.is_initialized():
        ray.shutdown()
    before = _descendants()
    # 3 prompts per mini-batch do not divide the 4 prompts per step
    cfg = load_config(tiny_overrides(tiny_assets, **{"actor_rollout_ref.actor.ppo_mini_batch_size": 3}))
    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):
        PPOTrainer(cfg)
    # the CLI: a typo'd key and a bad layout both exit with code 2 and start nothing
    assert main_ppo.main(tiny_overrides(tiny_assets) + ["actor_rollout_ref.actor.ppo_mini_bach_size=2"]) == 2
    assert main_ppo.main(tiny_overrides(tiny_assets, **{
        "trainer.n_gpus_per_node": 3, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 2})) == 2
    assert not ray.is_initialized()
    assert _descendants() - before == set(), "no process may start for a bad config"
