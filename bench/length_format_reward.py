"""The reward of ``bench/rl_step_vs_trl.py --workload compute``: long, digit-rich responses.

score = min(characters, TARGET_CHARS) / TARGET_CHARS + (digits / characters), in [0, 2].
The first term keeps responses at the length limit (the workload is about compute per trajectory),
the second gives the groups a spread so GRPO's advantages are not all zero. Both trainers call this
one function (verl_lite through ``reward.custom_reward_function``, TRL through a reward function).
"""

TARGET_CHARS = 64


def compute_score(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    text = solution_str.strip()
    if not text:
        return 0.0
    return min(len(text), TARGET_CHARS) / TARGET_CHARS + sum(ch.isdigit() for ch in text) / len(text)
