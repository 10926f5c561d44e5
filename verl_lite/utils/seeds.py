"""Every seed the RL loop derives from ``trainer.seed``, in one place, so a run is reproducible at its seed and
a resumed run draws what the uninterrupted one would have (the step is part of each derivation).

The constants are arbitrary primes chosen once; changing one changes every run's samples (tests and documented
numbers depend on them). The agent loop's per-turn seeds are ``verl_lite.agent.loop.turn_seed``.
"""

ROLLOUT_SEED_SPACE = 2**31 - 2**20  # below 2**31, with room for the per-prompt offsets added to it


def rollout_seed(seed: int, step: int) -> int:
    """The sampling seed of the rollouts RL step ``step`` (0-based) trains on; prompt p is sampled with it + p."""
    return (seed * 1_000_003 + step * 10_007) % ROLLOUT_SEED_SPACE


def dynamic_sampling_seed(step_seed: int, round_index: int) -> int:
    """DAPO's dynamic sampling: the seed of generation round ``round_index`` of a step seeded ``step_seed``."""
    return step_seed + round_index * 100_003


def validation_seed(seed: int, first_row: int) -> int:
    """Sampled validation (``val_kwargs.do_sample``): the seed of the chunk of held-out rows from ``first_row``."""
    return seed + 12345 + first_row


def shuffle_seed(seed: int, step: int, epoch: int, salt: int) -> int:
    """The mini-batch shuffle of one epoch of RL step ``step`` (salt 0: the actor's, 1: the critic's)."""
    return seed * 7919 + step * 104729 + epoch + salt


def cov_selection_seed(seed: int, step: int, mini_batch: int) -> int:
    """clip_cov / kl_cov: the token selection's seed for mini-batch ``mini_batch`` of RL step ``step``."""
    return seed * 65_537 + step * 131 + mini_batch
