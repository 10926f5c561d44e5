"""The shipped tiny tokenizers keep the text they are given: printable ASCII with spaces and newlines round-trips
exactly, loaded as transformers loads each shipped model directory (Qwen2Tokenizer) and as built; a character
outside the alphabet is the documented unknown token where the tokenizer is read as it is. The ids of the
alphabet are the ones the shipped models were trained with."""

from __future__ import annotations

import string

import pytest

from verl_lite.config.loader import ASSETS_DIR
from verl_lite.data.char_tokenizer import UNK_ID, build_char_tokenizer, char_vocab

TEXT = "Error executing tool 'calc': ValueError: bad input\nline 2\tends=42 " + string.ascii_letters + "!?<>{}[]"


@pytest.mark.parametrize("name", ["tiny-addition", "tool-agent", "tiny-addition-rm"])
def test_the_shipped_tokenizers_round_trip_printable_text(name):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ASSETS_DIR / name)
    text = TEXT.replace("\t", " ")  # tab is outside the alphabet (as \r, \x0b, \x0c)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert len(ids) == len(text)  # one token a character
    assert tok.encode("12+34=", add_special_tokens=False) == [char_vocab()[c] for c in "12+34="]  # trained ids


def test_outside_the_alphabet_is_the_unknown_token_as_built():
    tok = build_char_tokenizer()
    assert tok.decode(tok.encode("a b\nc", add_special_tokens=False)) == "a b\nc"
    assert tok.encode("é", add_special_tokens=False) == [UNK_ID, UNK_ID]  # one <unk> per UTF-8 byte
