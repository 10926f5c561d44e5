# volcengine/verl verl/interactions/gsm8k_interaction.py at b178a3cd56f58b2d502255daba591e92833930a7 (Apache-2.0, the
# verl authors), ported as the pre-flight's hint says: BaseInteraction from verl_lite, verl's gsm8k scorer ->
# verl_lite's gsm8k_score (its "#### <number>" rule); the rest unchanged.
from typing import Any, Optional
from uuid import uuid4

from verl_lite.agent.interaction import BaseInteraction
from verl_lite.reward.scorers import gsm8k_score


class Gsm8kInteraction(BaseInteraction):
    """A demo interaction for calculating the reward of gsm8k."""

    def __init__(self, config: dict):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                                **kwargs) -> str:
        if instance_id is None:
            instance_id = str(uuid4())
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs
                                ) -> tuple[bool, str, float, dict]:
        content = next((m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instance_dict[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k_score(state["response"], state["ground_truth"], format_score=0.0, score=1.0)

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
