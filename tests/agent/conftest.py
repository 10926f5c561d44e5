"""Fixtures of the agent tests: a tokenizer whose chat template renders tools and tool turns (the shipped
tiny model's tokenizer with another template), and a scripted rollout backend. Nothing heavy at import: a tool
defined in a test module is unpickled in each tool process, which imports that module and this one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

TOOL_TEMPLATE = (
    "{%- if tools %}<|system|>tools:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{% endif -%}"
    "{% for message in messages %}{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'tool' %}<|user|><tool_response>{{ message['content'] }}</tool_response>"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<eos>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tool_tokenizer_dir(dest: Path) -> Path:
    """The shipped tiny tokenizer with TOOL_TEMPLATE as its chat template."""
    from verl_lite.config.loader import default_model_path

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_model_path()) / name, dest / name)
    (dest / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return dest


@pytest.fixture(scope="session")
def tool_tokenizer_path(tmp_path_factory) -> str:
    return str(tool_tokenizer_dir(tmp_path_factory.mktemp("tool_tokenizer")))


@pytest.fixture(scope="session")
def tool_tokenizer(tool_tokenizer_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_tokenizer_path)


class ScriptedRollout:
    """A ``Rollout`` whose turn k of every trajectory is ``script(k, prompt_text)`` (text, EOS appended),
    with log-prob -0.5 per token; records every batched call."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []
        self.eos_token_id = tokenizer.eos_token_id

    def generate(self, prompt_ids, n=1, *, max_new_tokens=16, seeds=None, seed=None, **sampling):
        import torch

        self.calls.append({"batch": len(prompt_ids), "max_new_tokens": max_new_tokens, "seeds": seeds})
        outs = []
        for ids in prompt_ids:
            text = self.tokenizer.decode(ids)
            turn = text.count("<|assistant|>") - 1
            out = self.tokenizer.encode(self.script(turn, text), add_special_tokens=False) + [self.eos_token_id]
            out = out[:max_new_tokens]
            outs.append({"response_ids": out, "log_probs": torch.full((len(out),), -0.5)})
        return outs

    def load_weights(self, named_tensors):
        return 0
