"""Parquet round trip, chat template, overlong filter/truncation, bad-row errors, deterministic batches."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_lite.data import (
    DataError,
    RLDataset,
    build_char_tokenizer,
    iterate_batches,
    make_synthetic_task,
    score_addition,
)
from verl_lite.data.char_tokenizer import EOS_ID


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _row(content, gt="1", source="s", extra=None):
    return {"data_source": source, "prompt": [{"role": "user", "content": content}],
            "reward_model": {"ground_truth": gt}, "extra_info": extra or {"i": 0}}


def _write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_chat_template_tokens(tok):
    ids = tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "1+2="}],
                                  add_generation_prompt=True, tokenize=False)
    assert ids == "<|system|>s<|user|>1+2=<|assistant|>"
    full = tok.apply_chat_template([{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}],
                                   tokenize=False)
    assert full == "<|user|>1+2=<|assistant|>3<eos>"
    enc = tok.encode(full, add_special_tokens=False)
    assert enc[0] == tok.convert_tokens_to_ids("<|user|>") and enc[-1] == EOS_ID == tok.eos_token_id
    assert len(enc) == 1 + 4 + 1 + 1 + 1  # one token per character, specials atomic
    assert tok.decode(enc, skip_special_tokens=True) == "1+2=3"


def test_parquet_round_trip_and_items(tmp_path, tok):
    train, val = make_synthetic_task(tmp_path, n_train=64, n_val=16, seed=3)
    rows = pq.read_table(train).to_pylist()
    ds = RLDataset([str(train)], tok, max_prompt_length=32)
    assert len(ds) == 64 and ds.num_filtered == 0
    for k, row in enumerate(rows):
        item = ds[k]
        expect = [tok.convert_tokens_to_ids("<|user|>")] + [tok.convert_tokens_to_ids(c) for c in
                                                              row["prompt"][0]["content"]] + [
            tok.convert_tokens_to_ids("<|assistant|>")]
        assert item["prompt_ids"] == expect
        assert item["data_source"] == "synthetic/addition" and item["index"] == k
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert item["ground_truth"] == str(a + b) and item["extra_info"]["a"] == a
        assert score_addition(str(a + b), item["ground_truth"]) == 1.0
    # train and val operand pairs are disjoint; val does not depend on n_train
    val_pairs = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in pq.read_table(val).to_pylist()}
    assert not val_pairs & {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows}
    _, val2 = make_synthetic_task(tmp_path / "b", n_train=10, n_val=16, seed=3)
    assert pq.read_table(val2).to_pylist() == pq.read_table(val).to_pylist()
    # two files are concatenated
    ds2 = RLDataset([str(train), str(val)], tok, max_prompt_length=32)
    assert len(ds2) == 80 and ds2[64]["index"] == 64


def test_overlong_filter_and_truncation(tmp_path, tok, capsys):
    f = _write(tmp_path / "d.parquet", [_row("x" * n) for n in (1, 5, 6, 10)])  # prompt = n + 2 tokens
    ds = RLDataset(f, tok, max_prompt_length=7, filter_overlong_prompts=True)
    assert len(ds) == 2 and ds.num_filtered == 2 and ds.num_rows == 4
    assert "dropped 2/4 prompts" in capsys.readouterr().out
    assert [it["index"] for it in ds] == [0, 1]
    for explicit in ({"filter_overlong_prompts": False}, {}):  # the default is the data section's: no filter
        with pytest.raises(DataError, match=r"d\.parquet row 2: prompt has 8 tokens > data\.max_prompt_length=7"):
            RLDataset(f, tok, max_prompt_length=7, **explicit)
    left = RLDataset(f, tok, max_prompt_length=7, filter_overlong_prompts=False, truncation="left")
    right = RLDataset(f, tok, max_prompt_length=7, filter_overlong_prompts=False, truncation="right")
    full = RLDataset(f, tok, max_prompt_length=100)
    assert left[3]["prompt_ids"] == full[3]["prompt_ids"][-7:]
    assert right[3]["prompt_ids"] == full[3]["prompt_ids"][:7]
    with pytest.raises(DataError, match="no prompts left"):
        RLDataset(f, tok, max_prompt_length=2, filter_overlong_prompts=True)


@pytest.mark.parametrize(
    "rows,match",
    [
        ([{"data_source": "s", "reward_model": {"ground_truth": "1"}}], r"missing column\(s\) \['prompt'\]"),
        ([{**_row("b"), "prompt": "  "}], r"row 0: 'prompt' is empty"),
        ([{**_row("b"), "prompt": 7}], r"row 0: 'prompt' must be plain text or a non-empty list of chat messages"),
        ([{**_row("a"), "prompt": [{"role": "user", "content": None}]}], r"row 0: message 0 of 'prompt'"),
        ([{**_row("a"), "reward_model": "x"}], r"row 0: 'reward_model' must be a dict"),
    ],
)
def test_bad_rows_name_file_and_row(tmp_path, tok, rows, match):
    f = _write(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataError, match=match) as info:
        RLDataset(f, tok, max_prompt_length=32)
    assert "bad.parquet" in str(info.value)


def test_missing_file(tok):
    with pytest.raises(DataError, match="does not exist"):
        RLDataset("/nonexistent.parquet", tok, max_prompt_length=8)


def test_iterate_batches_deterministic(tmp_path, tok):
    f = _write(tmp_path / "d.parquet", [_row(str(i)) for i in range(10)])
    ds = RLDataset(f, tok, max_prompt_length=32)
    idx = lambda bs: [[it["index"] for it in b] for b in bs]  # noqa: E731
    e0 = idx(iterate_batches(ds, 4, shuffle=True, seed=1, epoch=0))
    assert len(e0) == 2 and all(len(b) == 4 for b in e0) and len(set(sum(e0, []))) == 8
    assert e0 == idx(iterate_batches(ds, 4, shuffle=True, seed=1, epoch=0))
    assert e0 != idx(iterate_batches(ds, 4, shuffle=True, seed=1, epoch=1))
    assert e0 != idx(iterate_batches(ds, 4, shuffle=True, seed=2, epoch=0))
    assert idx(iterate_batches(ds, 4, shuffle=False)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert idx(iterate_batches(ds, 4, shuffle=False, drop_last=False))[-1] == [8, 9]
    with pytest.raises(DataError, match="lower data.train_batch_size"):
        list(iterate_batches(ds, 11))


def test_synthetic_demonstrations_and_strict_scorer(tmp_path):
    train, _ = make_synthetic_task(tmp_path, n_train=400, n_val=8, seed=1, restate_fraction=0.5)
    rows = pq.read_table(train).to_pylist()
    restated = 0
    for r in rows:
        a, b, demo = r["extra_info"]["a"], r["extra_info"]["b"], r["extra_info"]["demonstration"]
        assert demo in (str(a + b), f"{a}+{b}={a + b}")
        restated += demo != str(a + b)
        # the strict verifier accepts the bare sum only
        assert score_addition(demo, r["reward_model"]["ground_truth"]) == float(demo == str(a + b))
    assert 150 < restated < 250  # ~ Binomial(400, 0.5)
    train0, _ = make_synthetic_task(tmp_path / "z", n_train=50, n_val=8, seed=1)
    assert all(r["extra_info"]["demonstration"] == r["reward_model"]["ground_truth"]
               for r in pq.read_table(train0).to_pylist())
    with pytest.raises(ValueError, match="distinct pairs"):
        make_synthetic_task(tmp_path / "y", n_train=20000, n_val=8, max_digits=2)


def test_a_role_the_template_drops_is_refused_and_a_known_one_is_kept(tok, tmp_path):
    """The char tokenizer's template (like many) renders system/user/assistant only: a message with a
    mistyped role would vanish, leaving the prompt without its question."""
    bad = _row("90+45=")
    bad["prompt"] = [{"role": "usr", "content": "90+45="}]
    with pytest.raises(DataError, match=r"row 0: message 0 of 'prompt' has role 'usr', which the tokenizer's chat "
                                        r"template drops"):
        RLDataset(_write(tmp_path / "r.parquet", [bad]), tok, max_prompt_length=64)
    good = RLDataset(_write(tmp_path / "g.parquet", [_row("90+45=")]), tok, max_prompt_length=64)
    assert tok.decode(good[0]["prompt_ids"]) == "<|user|>90+45=<|assistant|>"


def test_a_file_without_rows_says_so(tok, tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist([_row("1+1=")]).slice(0, 0), empty)
    with pytest.raises(DataError, match=r"no rows; give files with at least one prompt"):
        RLDataset(str(empty), tok, max_prompt_length=64)


def test_reward_fn_key_names_the_data_source_column(tok, tmp_path):
    """``data.reward_fn_key`` (verl's name): the column whose value each row's reward receives as its data
    source; a key that names no column is refused, naming the key."""
    rows = [dict(_row("1+1=", source="default_col"), task="gsm8k"), dict(_row("2+2=", source="default_col"), task="math")]
    f = _write(tmp_path / "k.parquet", rows)
    assert [it["data_source"] for it in RLDataset(f, tok, max_prompt_length=64)] == ["default_col"] * 2
    assert [it["data_source"] for it in RLDataset(f, tok, max_prompt_length=64, data_source_key="task")] == \
        ["gsm8k", "math"]
    with pytest.raises(DataError, match=r"no 'nonexistent_col' column \(data\.reward_fn_key\)"):
        RLDataset(f, tok, max_prompt_length=64, data_source_key="nonexistent_col")
