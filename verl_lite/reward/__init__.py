"""Rewards: built-in rule scorers, the data_source router, user functions by file path, managers.

    manager = RewardManager(cfg.reward, tokenizer)
    scores, extra = manager(response_ids_list, data_sources, ground_truths, extra_infos)
"""

from verl_lite.reward.config import REWARD_MANAGERS
from verl_lite.reward.manager import RewardConfigError, RewardError, RewardManager
from verl_lite.reward.scorers import (boxed_math_score, default_compute_score, extract_gsm8k_answer, gsm8k_score,
                                      is_equiv, last_boxed_content, normalize_math_answer)

__all__ = ["REWARD_MANAGERS", "RewardConfigError", "RewardError", "RewardManager", "boxed_math_score",
           "default_compute_score", "extract_gsm8k_answer", "gsm8k_score", "is_equiv", "last_boxed_content",
           "normalize_math_answer"]
