"""A character-level HF fast tokenizer with a chat template, built locally with `tokenizers`.

Used by the shipped tiny model (`verl_lite/assets/tiny-*`) and by tests: no model hub needed.

Vocabulary: special tokens first (ids 0..6), then every printable ASCII character and "\n" as one token each,
in GPT-2's byte-level spelling (space "Ġ", newline "Ċ"): a BPE model without merges, so text splits into
characters both as it is and under the Qwen2Tokenizer transformers imposes on a Qwen2 model directory. A non-ASCII
character is `<unk>` (id 3, once per UTF-8 byte), or left out by Qwen2Tokenizer (its BPE has no unknown token).

    id 0 <pad>   id 1 <bos>   id 2 <eos>   id 3 <unk>
    id 4 <|system|>   id 5 <|user|>   id 6 <|assistant|>

Chat template (what `apply_chat_template` renders, no spaces or newlines added):

    <|system|>{system}<|user|>{user}<|assistant|>{assistant}<eos> ...
    and, with add_generation_prompt=True, a trailing <|assistant|>.

So a generated response ends with `<eos>` (id 2), which is also the model's `eos_token_id`.
"""

from __future__ import annotations

import string
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}<eos>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# The same template with tools (the tool-agent model, verl_lite/assets/tool-agent): the tool list as
# `<|system|>tools:name(param,...);` before the conversation, an assistant's tool calls in the hermes
# format (`<tool_call>{"name":...,"arguments":{...}}</tool_call>`, compact JSON) before its <eos>, and a
# tool response as a user turn `<|user|><tool_response>{content}</tool_response>` (as Qwen2.5 renders it).
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>tools:{% for t in tools %}{{ t['function']['name'] }}("
    "{{ (t['function']['parameters'] or {}).get('properties', {}) | join(',') }});{% endfor %}{% endif -%}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'tool' %}<|user|><tool_response>{{ message['content'] }}</tool_response>"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson(separators=(',', ':')) }}"
    "</tool_call>{% endfor %}<eos>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


BYTE_LEVEL_SPELLING = {" ": "\u0120", "\n": "\u010a"}  # GPT-2's byte-to-unicode map, where it is not the identity


def char_vocab() -> dict[str, int]:
    """Token -> id: the special tokens, then printable ASCII (minus \\t\\r\\x0b\\x0c) and '\\n', byte-level spelled."""
    chars = [BYTE_LEVEL_SPELLING.get(c, c) for c in string.printable if c not in "\t\r\x0b\x0c"]
    return {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}


def build_char_tokenizer(model_max_length: int = 4096):
    """Return a `transformers.PreTrainedTokenizerFast` splitting text into single characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=char_vocab(), merges=[], unk_token="<unk>"))  # no merges: one token a character
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_char_tokenizer(out_dir: str | Path) -> Path:
    """Write the tokenizer files (tokenizer.json, tokenizer_config.json with the chat template) to out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer().save_pretrained(out)
    return out
