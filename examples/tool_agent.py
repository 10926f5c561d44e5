"""Multi-turn GRPO with two plain Python functions as tools, through the Python API (TRL's ``tools=``).

    python examples/tool_agent.py [output_dir]

``PPOTrainer(..., tools=[add, multiply])`` turns on multi-turn rollouts
(``actor_rollout_ref.rollout.multi_turn.enable``, the ``tool_agent`` loop): each function's schema
comes from its type hints and docstring, the model's chat template renders the tool list into the
prompt, a ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in a model turn runs the tool
(bounded by ``multi_turn.tool_timeout_s``) and its answer is appended as environment tokens (mask 0,
never in the loss), and the model continues. See docs/agents.md.

The shipped tiny model was trained without tools and its chat template has no tool role, so this
example gives it a tokenizer whose template renders tools and tool turns (``tool_tokenizer``). It runs
end to end but does not learn to call tools: that needs a model warm-started on tool-call
demonstrations.
"""

import shutil
import sys
from pathlib import Path

from verl_lite.config import load_config
from verl_lite.config.loader import default_model_path
from verl_lite.trainer.ppo_trainer import PPOTrainer

TOOL_TEMPLATE = (
    "{%- if tools %}<|system|>tools:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{% endif -%}"
    "{% for message in messages %}{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'tool' %}<|user|><tool_response>{{ message['content'] }}</tool_response>"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<eos>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


async def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def final_answer(completions, ground_truth, **kwargs):
    """1.0 when the completion (tool turns included) ends with the right number."""
    return [1.0 if c.strip().endswith(str(g).strip()) else 0.0 for c, g in zip(completions, ground_truth)]


def tool_tokenizer(dest: Path) -> str:
    """The shipped tiny tokenizer with a chat template that renders tools and tool turns."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_path()) / name, dest / name)
    (dest / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return str(dest)


def main(output_dir: str = "outputs/tool_agent", steps: int = 4):
    tokenizer = tool_tokenizer(Path(output_dir) / "tool_tokenizer")
    cfg = load_config([f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}",
                       f"trainer.output_dir={output_dir}", f"actor_rollout_ref.model.tokenizer_path={tokenizer}",
                       "data.max_prompt_length=40", "data.max_response_length=64", "data.train_batch_size=4",
                       "data.val_batch_size=8", "actor_rollout_ref.rollout.n=4",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3"])
    trainer = PPOTrainer(cfg, reward_funcs=[final_answer], tools=[add, multiply])
    history = trainer.fit(on_step=lambda m: print(
        f"step {m['step']:3d}  reward {m.get('reward/mean', float('nan')):.3f}  "
        f"turns {m.get('agent/turns_mean', float('nan')):.2f}  tool calls {m.get('agent/tool_calls_mean', float('nan')):.2f}"
        f"  val acc {m.get('val/accuracy', float('nan')):.3f}"))
    print("run directory:", trainer.run_dir)
    return trainer, history


if __name__ == "__main__":
    main(*sys.argv[1:2])
