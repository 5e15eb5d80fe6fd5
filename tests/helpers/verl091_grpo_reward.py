"""The tiny GRPO run's reward, through verl's ``reward.custom_reward_function`` (``verl/trainer/config/reward/
reward.yaml:8-13``): the share of digits in the response text, in [0, 1].

The untrained tiny model never writes the right ``\\boxed{}`` answer that gsm8k's rule rewards, so every group would
score 0, GRPO's advantages would be 0 and the actor would not move; this score differs between the samples of a
group (temperature 1), so each step has non-zero advantages and an update for the weight sync to carry.
"""

from __future__ import annotations

from typing import Any


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any
) -> float:
    """Digits / characters of ``solution_str`` (0.0 when empty)."""
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
