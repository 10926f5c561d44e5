"""Tool calls in each built format (``multi_turn.format``: hermes, llama3_json, gpt-oss) parse back to what the
family's chat template rendered, through transformers' response parser: the same name and arguments, several calls
of one turn in order, a malformed or unknown call kept as a call with its error, text without a call left alone.
The families' templates are written here as each family renders an assistant turn with tool calls (the shipped tiny
tokenizers render tool calls in the hermes format only), and rendered by the tokenizer's own ``apply_chat_template``.
Then the key: every format accepted, another refused before start naming the built ones, a tokenizer without the
format's tokens refused at pre-flight, and a gpt-oss turn through the agent loop (its special tokens kept, generation
stopping at ``<|call|>``)."""

from __future__ import annotations

from pathlib import Path

import pytest

import verl_lite
from tests.agent.conftest import ScriptedRollout
from verl_lite.agent import AgentRunner, AgentSpec, ToolConfigError, parse_tool_calls
from verl_lite.agent.config import MultiTurnConfig
from verl_lite.agent.preflight import agent_spec, multi_turn_values
from verl_lite.agent.tool_calls import FORMATS, stop_token_ids
from verl_lite.agent.tools import FunctionTool

KNOWN = {"add", "mul"}
ASSETS = Path(verl_lite.__file__).parent / "assets"
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>", "<|end|>", "<|return|>"]

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


# an assistant turn with tool calls, as each family's chat template renders it (Qwen2.5 / Qwen3: hermes blocks on
# their own lines; Llama 3.1: one JSON object with "parameters"; gpt-oss: one harmony commentary message per call,
# the recipient in the header); the generation prompt is what the model's turn follows
QWEN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
        "{% if m.content or not loop.first %}\n{% endif %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
        "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA31 = ("{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{% if m.tool_calls %}"
           "{% set c = m.tool_calls[0].function %}{\"name\": \"{{ c.name }}\", \"parameters\": "
           "{{ c.arguments | tojson }}}{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
           "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
GPT_OSS = ("{% for m in messages %}{% if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
           "{% else %}{% for c in m.tool_calls or [] %}<|start|>assistant to=functions.{{ c.function.name }}"
           "<|channel|>commentary json<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}{% endif %}"
           "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
END_OF_TURN = {"hermes": "<|im_end|>", "llama3_json": "<|eot_id|>", "gpt-oss": None}  # None: kept (decoded as is)
ARGUMENTS = [{"a": 2, "b": 3}, {"expression": "876*141", "note": 'say "hi"; then {stop}'},
             {"nested": {"xs": [1, 2.5, None, True]}, "text": "café <b>\nline"}, {}]


def _turn(tokenizer, template: str, fmt: str, calls: list[tuple[str, dict]], content: str = "") -> str:
    """The model's turn text for an assistant message with ``calls``, rendered by ``template``: what follows the
    generation prompt, up to the end-of-turn token that decoding drops (gpt-oss's tokens are all kept)."""
    user = [{"role": "user", "content": "2+3="}]
    message = {"role": "assistant", "content": content,
               "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}
    prompt = tokenizer.apply_chat_template(user, chat_template=template, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template(user + [message], chat_template=template, tokenize=False)
    assert full.startswith(prompt)
    turn = full[len(prompt):]
    return turn.split(END_OF_TURN[fmt])[0] if END_OF_TURN[fmt] else turn


def _parsed(text: str, fmt: str) -> tuple[str, list[tuple]]:
    content, calls = parse_tool_calls(text, KNOWN, fmt)
    return content, [(c.name, c.arguments, c.error) for c in calls]


# ------------------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("arguments", ARGUMENTS)
@pytest.mark.parametrize("fmt, template", [("hermes", QWEN), ("llama3_json", LLAMA31), ("gpt-oss", GPT_OSS)])
def test_a_call_rendered_by_the_family_template_parses_back(tool_tokenizer, fmt, template, arguments):
    text = _turn(tool_tokenizer, template, fmt, [("mul", arguments)])
    assert _parsed(text, fmt)[1] == [("mul", arguments, None)]


def test_hermes_round_trip_through_the_shipped_tool_agent_template():
    from transformers import AutoTokenizer

    from verl_lite.data.char_tokenizer import TOOL_CHAT_TEMPLATE

    tok = AutoTokenizer.from_pretrained(ASSETS / "tool-agent")
    assert tok.chat_template == TOOL_CHAT_TEMPLATE
    calls = [("add", {"a": 2, "b": 3}), ("mul", {"a": 4, "b": 5})]
    text = _turn(tok, tok.chat_template, "hermes", calls, content="Let me compute.").split("<eos>")[0]
    assert _parsed(text, "hermes") == ("Let me compute.", [(n, a, None) for n, a in calls])


def test_the_forms_models_generate_parse_too():
    """gpt-oss writes the recipient after the channel, with a constrain token, after its analysis; Llama 3 starts a
    call with <|python_tag|> and ends it with <|eom_id|> when the special tokens are kept."""
    harmony = ("<|channel|>analysis<|message|>Need the product.<|end|><|start|>assistant<|channel|>commentary "
               'to=functions.mul <|constrain|>json<|message|>{"a": 876, "b": 141}<|call|>')
    assert _parsed(harmony, "gpt-oss") == ("", [("mul", {"a": 876, "b": 141}, None)])
    llama = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}<|eom_id|>'
    assert _parsed(llama, "llama3_json") == ("", [("add", {"a": 1, "b": 2}, None)])


# ------------------------------------------------------------------------------------------- several, malformed, none
def test_several_calls_in_one_turn_in_order(tool_tokenizer):
    calls = [("add", {"a": 1, "b": 2}), ("mul", {"a": 3, "b": 4}), ("add", {"a": 5, "b": 6})]
    expected = [(n, a, None) for n, a in calls]
    content, got = _parsed(_turn(tool_tokenizer, QWEN, "hermes", calls, content="Three."), "hermes")
    assert (content.strip(), got) == ("Three.", expected)  # the newlines between the blocks stay in the content
    assert _parsed(_turn(tool_tokenizer, GPT_OSS, "gpt-oss", calls), "gpt-oss")[1] == expected
    llama = "<|python_tag|>" + "; ".join(_turn(tool_tokenizer, LLAMA31, "llama3_json", [c]) for c in calls)
    assert _parsed(llama, "llama3_json")[1] == expected  # Llama 3's template renders one; vLLM's "; " joins several


MALFORMED = {
    "hermes": ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', "", "Invalid JSON in tool call: "),
    "llama3_json": ('<|python_tag|>{"name": "add", "parameters": {"a": 1', "", "Invalid JSON in tool call: "),
    "gpt-oss": ('<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1<|call|>', "add",
                "Invalid JSON in the arguments of 'add': "),
}
UNKNOWN = {
    "hermes": '<tool_call>{"name": "divide", "arguments": {"a": 1}}</tool_call>',
    "llama3_json": '{"name": "divide", "parameters": {"a": 1}}',
    "gpt-oss": '<|channel|>commentary to=functions.divide <|constrain|>json<|message|>{"a": 1}<|call|>',
}
NO_CALL = {
    "hermes": ("The answer is 5 <tool_call> never closed", "The answer is 5 <tool_call> never closed"),
    "llama3_json": ('The answer is {"name": "five"}', 'The answer is {"name": "five"}'),
    "gpt-oss": ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>"
                "The answer is 5<|return|>", "The answer is 5"),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_a_malformed_call_is_a_call_with_its_error(fmt):
    text, name, error = MALFORMED[fmt]
    [(got_name, arguments, got_error)] = _parsed(text, fmt)[1]
    assert (got_name, arguments) == (name, {}) and got_error.startswith(error) and "line 1 column" in got_error


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_an_unknown_tool_is_a_call_with_its_error(fmt):
    assert _parsed(UNKNOWN[fmt], fmt)[1] == [("divide", {"a": 1}, "Unknown function 'divide'. Available tools: "
                                                                   "['add', 'mul']")]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_text_without_a_call_has_none(fmt):
    text, content = NO_CALL[fmt]
    assert _parsed(text, fmt) == (content, [])


def test_arguments_that_are_not_an_object_are_an_error():
    _, calls = _parsed('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "hermes")
    assert calls == [("add", {}, "Invalid arguments for 'add': expected a JSON object, got [1, 2]")]
    _, calls = _parsed('<tool_call>["add"]</tool_call>', "hermes")
    assert calls == [("", {}, 'Invalid tool call: expected {"name": <tool name>, "arguments": {...}}')]
    _, calls = _parsed('<|python_tag|>{"tool": "add"}', "llama3_json")
    assert calls == [("", {}, 'Invalid tool call: expected {"name": <tool name>, "arguments": {...}}')]


# ------------------------------------------------------------------------------------------- the key
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_built_format_is_accepted(fmt):
    from verl_lite.config import load_config, validate_config

    cfg = load_config([f"actor_rollout_ref.rollout.multi_turn.format={fmt}"])
    validate_config(cfg, world_size=1)
    assert cfg.actor_rollout_ref.rollout.multi_turn.format == fmt


def test_an_unknown_format_is_refused_before_start_naming_the_built_ones(tmp_path, capsys):
    import ray

    from verl_lite.trainer import main_ppo

    was_running = ray.is_initialized()
    code = main_ppo.main(["actor_rollout_ref.rollout.multi_turn.format=pythonic", f"trainer.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert ("actor_rollout_ref.rollout.multi_turn.format='pythonic' is not a built tool-call format; choose one of "
            "['hermes', 'llama3_json', 'gpt-oss']") in err
    assert "Traceback" not in err and ray.is_initialized() == was_running and list(tmp_path.iterdir()) == []


def _harmony_tokenizer(tool_tokenizer_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_tokenizer_path)
    tok.add_tokens(HARMONY_TOKENS, special_tokens=True)
    return tok


def _gpt_oss_config():
    from verl_lite.config import load_config

    return load_config(["actor_rollout_ref.rollout.multi_turn.enable=true",
                        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
                        "actor_rollout_ref.rollout.multi_turn.format=gpt-oss"])


def test_a_tokenizer_without_the_formats_tokens_is_refused_at_preflight(tool_tokenizer, tool_tokenizer_path):
    with pytest.raises(ToolConfigError) as e:
        agent_spec(_gpt_oss_config(), tools=[add], tokenizer=tool_tokenizer)
    assert ("actor_rollout_ref.rollout.multi_turn.format=gpt-oss: the tokenizer has no <|channel|>, <|message|>, "
            "<|call|> token(s), which gpt-oss writes its tool calls with; set it to the model family's format (one "
            "of ['hermes', 'llama3_json', 'gpt-oss'])") in str(e.value)
    spec = agent_spec(_gpt_oss_config(), tools=[add], tokenizer=_harmony_tokenizer(tool_tokenizer_path))
    assert spec.multi_turn["format"] == "gpt-oss"


def test_stop_tokens_are_those_the_tokenizer_has(tool_tokenizer, tool_tokenizer_path):
    tok = _harmony_tokenizer(tool_tokenizer_path)
    assert stop_token_ids(tok, "gpt-oss") == [tok.convert_tokens_to_ids("<|call|>")]
    assert stop_token_ids(tool_tokenizer, "gpt-oss") == stop_token_ids(tool_tokenizer, "llama3_json") == []
    tok.add_tokens(["<|eom_id|>"], special_tokens=True)
    assert stop_token_ids(tok, "llama3_json") == [tok.convert_tokens_to_ids("<|eom_id|>")]
    assert stop_token_ids(tok, "hermes") == []


class _StopsRecorder(ScriptedRollout):
    """A scripted rollout that records the stop tokens each backend call is given."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.stops = []

    def generate(self, prompt_ids, n=1, **sampling):
        self.stops.append(sampling.pop("stop_token_ids", None))
        return super().generate(prompt_ids, n, **sampling)


def test_a_gpt_oss_turn_through_the_agent_loop(tool_tokenizer_path):
    from verl_lite.data.dataset import encode_prompt

    tok = _harmony_tokenizer(tool_tokenizer_path)
    call = ('<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>commentary to=functions.add '
            '<|constrain|>json<|message|>{"a": 2, "b": 3}<|call|>')
    rollout = _StopsRecorder(tok, lambda turn, text: call if turn == 0 else "<|channel|>final<|message|>5")
    spec = AgentSpec(multi_turn=dict(multi_turn_values(MultiTurnConfig(format="gpt-oss")), enable=True),
                     default_agent_loop="tool_agent", functions=[add, mul], max_response_length=400)
    messages = [{"role": "user", "content": "2+3="}]
    row = {"prompt_ids": encode_prompt(tok, messages, [FunctionTool(add).schema]), "messages": messages,
           "data_source": "t", "ground_truth": "5", "extra_info": {}, "agent_name": None}
    out = AgentRunner(rollout, tok, spec).run([row], None, {"n": 1, "do_sample": False})[0]
    stats = out["agent_stats"]
    assert (stats["tool_calls"], stats["tool_errors"], stats["stop_reason"]) == (1, 0, "no_tool_call")
    assert "<tool_response>5</tool_response>" in tok.decode(out["response_ids"])
    call_id = tok.convert_tokens_to_ids("<|call|>")
    assert rollout.stops == [[call_id], [call_id]]  # both turns' backend calls stop at <|call|>
