# volcengine/verl verl/tools/gsm8k_tool.py at b178a3cd56f58b2d502255daba591e92833930a7 (Apache-2.0, the verl authors),
# ported as the pre-flight's hint says: BaseTool from verl_lite, verl's gsm8k scorer -> verl_lite's gsm8k_score (its
# "#### <number>" rule), ToolResponse(text=...) -> the text, verl's tracing decorator dropped; the rest unchanged.
from typing import Any, Optional
from uuid import uuid4

from verl_lite.agent.tools import BaseTool
from verl_lite.reward.scorers import gsm8k_score


class Gsm8kTool(BaseTool):
    """A demo tool for calculating the reward of gsm8k."""

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        self._instance_dict = {}

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs):
        if instance_id is None:
            instance_id = str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth", None)
        self._instance_dict[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, None

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        self._instance_dict[instance_id]["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > self._instance_dict[instance_id]["reward"] else -0.05
        self._instance_dict[instance_id]["reward"] = reward
        return f"Current parsed {answer=} {reward=}", tool_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instance_dict[instance_id]
        return gsm8k_score(state["response"], state["ground_truth"], format_score=0.0, score=1.0)

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instance_dict[instance_id]
