"""Every seed the RL loop derives from ``trainer.seed``, in one place: a run is reproducible at its seed, and a
resumed run draws what the uninterrupted one would have (the step is part of each). The primes are arbitrary and
fixed: changing one changes every run's samples. The agent loop's per-turn seeds: ``agent.loop.turn_seed``."""

ROLLOUT_SEED_SPACE = 2**31 - 2**20  # below 2**31, with room for the per-prompt offsets added to a rollout seed


def rollout_seed(seed: int, step: int) -> int:
    """The rollouts RL step ``step`` (0-based) trains on; prompt p is sampled with this + p."""
    return (seed * 1_000_003 + step * 10_007) % ROLLOUT_SEED_SPACE


def dynamic_sampling_seed(step_seed: int, round_index: int) -> int:
    """DAPO's dynamic sampling: generation round ``round_index`` of a step whose rollout seed is ``step_seed``."""
    return step_seed + round_index * 100_003


def validation_seed(seed: int, first_row: int) -> int:
    """Sampled validation (``val_kwargs.do_sample``): the chunk of held-out rows from ``first_row``."""
    return seed + 12345 + first_row


def shuffle_seed(seed: int, step: int, epoch: int, salt: int) -> int:
    """The mini-batch shuffle of ``epoch`` of RL step ``step`` (salt 0: the actor's, 1: the critic's)."""
    return seed * 7919 + step * 104729 + epoch + salt


def cov_selection_seed(seed: int, step: int, mini_batch: int) -> int:
    """clip_cov / kl_cov: the token selection of mini-batch ``mini_batch`` of RL step ``step``."""
    return seed * 65_537 + step * 131 + mini_batch


def stream_group_seed(seed: int, first_step: int, group: int) -> int:
    """Streamed rollouts (``trainer.v1.trainer_mode=colocate_async`` or ``separate_async``): the seed of prompt group ``group`` (numbered
    from 0 in submission order) of a run (or resumed run) that started at RL step ``first_step``."""
    return (rollout_seed(seed, first_step) + group * 7_919) % ROLLOUT_SEED_SPACE
