"""Parquet prompt datasets in verl's row format, chat-templated, with the overlong-prompt filter.

A row:

    data_source:  str                                   (routes the reward)
    prompt:       list[{"role": str, "content": str}]   (column name = prompt_key)
    reward_model: {"ground_truth": ..., "style": ...}   (ground_truth required)
    extra_info:   dict | None                           (optional; passed to the reward function)

`RLDataset(files, tokenizer, max_prompt_length)` reads every file (pyarrow), checks every row,
renders the chat template with `add_generation_prompt=True` and tokenizes it without adding
special tokens again. Prompts longer than max_prompt_length are dropped when
filter_overlong_prompts (the count is in `num_filtered` and printed), otherwise handled by
`truncation` ("error" raises naming the file and row, "left" keeps the last tokens, "right"
the first). Item i is

    {"prompt_ids": list[int], "data_source": str, "ground_truth": Any, "extra_info": dict,
     "index": int}   # index: position of the row in the concatenated files

In-memory data (the Python API): a list of dicts or an HF ``datasets.Dataset`` instead of files.
Such rows may also be written the short way: ``prompt`` a string (one user message),
``ground_truth`` at the top level, ``data_source`` omitted (``"python"``), and any other key
merged into ``extra_info`` (so reward functions receive it as a keyword argument).

`iterate_batches(dataset, batch_size, shuffle, seed, epoch)` yields lists of items; the order is
a deterministic function of (seed, epoch) (the same on every process, no global RNG).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Iterator, Sequence

TRUNCATIONS = ("error", "left", "right")


class DataError(ValueError):
    """A dataset file or row is not in the expected format; the message names file, row and fix."""

    exit_code, describe_prefix = 2, "bad data: "  # verl_lite.errors.describe


def _read_rows(path: Path, prompt_key: str) -> list[dict]:
    import pyarrow.parquet as pq

    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DataError(f"{path}: cannot be read as parquet ({type(e).__name__}: {e})") from e
    required = (prompt_key, "data_source", "reward_model")
    missing = [c for c in required if c not in table.column_names]
    if missing:
        raise DataError(
            f"{path}: missing column(s) {missing}; found {table.column_names}. Rows need "
            f"'{prompt_key}' (chat messages), 'data_source' and 'reward_model' ({{'ground_truth': ...}}); "
            f"set data.prompt_key if the prompt column has another name"
        )
    return table.to_pylist()


def _check_row(row: dict, path: Path, i: int, prompt_key: str) -> list[dict]:
    """Return the row's messages; raise DataError naming file and row on a bad row."""
    where = f"{path} row {i}"
    messages = row[prompt_key]
    if isinstance(messages, str):
        raise DataError(
            f"{where}: '{prompt_key}' is a string; it must be a list of chat messages "
            f"[{{'role': 'user', 'content': ...}}]"
        )
    if not isinstance(messages, (list, tuple)) or not messages:
        raise DataError(f"{where}: '{prompt_key}' must be a non-empty list of chat messages, got {messages!r}")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {j} of '{prompt_key}' must be {{'role': str, 'content': str}}, got {m!r}")
    if not any(m["content"].strip() for m in messages):
        raise DataError(f"{where}: every message of '{prompt_key}' has empty content; give the prompt text or drop the row")
    if not isinstance(row["data_source"], str):
        raise DataError(f"{where}: 'data_source' must be a string, got {row['data_source']!r}")
    rm = row["reward_model"]
    if not isinstance(rm, dict) or rm.get("ground_truth") is None:
        raise DataError(f"{where}: 'reward_model' must be a dict with a 'ground_truth', got {rm!r}")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DataError(f"{where}: 'extra_info' must be a dict or null, got {type(extra).__name__}")
    return list(messages)


IN_MEMORY = "<in-memory dataset>"
VERL_ROW_KEYS = ("data_source", "reward_model", "extra_info")


def _in_memory_row(row: dict, i: int, prompt_key: str) -> dict:
    """A Python-API row in verl's format (see the module docstring for the short form)."""
    if not isinstance(row, dict):
        raise DataError(f"{IN_MEMORY} row {i}: rows must be dicts, got {type(row).__name__}")
    if prompt_key not in row:
        raise DataError(f"{IN_MEMORY} row {i}: no {prompt_key!r} key (keys: {sorted(row)})")
    prompt = row[prompt_key]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    reward_model = row.get("reward_model")
    if reward_model is None and "ground_truth" in row:
        reward_model = {"ground_truth": row["ground_truth"]}
    extra = dict(row.get("extra_info") or {})
    extra.update({k: v for k, v in row.items() if k not in (prompt_key, "ground_truth", *VERL_ROW_KEYS)})
    return {prompt_key: messages, "data_source": row.get("data_source", "python"), "reward_model": reward_model,
            "extra_info": extra}


def _sources(files) -> list[tuple[str, list[dict]]]:
    """(name, rows) per source: parquet path(s), a list of dicts, or an HF ``datasets.Dataset``."""
    if hasattr(files, "to_list") and not isinstance(files, (str, Path)):  # datasets.Dataset
        files = files.to_list()
    if isinstance(files, (list, tuple)) and files and all(isinstance(r, dict) for r in files):
        return [(IN_MEMORY, list(files))]
    files = [files] if isinstance(files, (str, Path)) else list(files)
    return [(str(f), None) for f in files]


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Chat template with the generation prompt, tokenized without adding special tokens twice."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


class RLDataset:
    """Prompts from parquet files, tokenized (see module docstring)."""

    def __init__(
        self,
        files: str | Sequence[str] | Sequence[dict],
        tokenizer,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
        verbose: bool = True,
    ):
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation={truncation!r} is unknown; choose one of {TRUNCATIONS}")
        sources = _sources(files)
        if not sources:
            raise DataError("no data files given; set data.train_files / data.val_files")
        self.files = [name for name, _ in sources]
        self.items: list[dict[str, Any]] = []
        self.num_rows = 0
        self.num_filtered = 0
        for f, memory_rows in sources:
            path = Path(f)
            rows = (_read_rows(path, prompt_key) if memory_rows is None
                    else [_in_memory_row(r, i, prompt_key) for i, r in enumerate(memory_rows)])
            for i, row in enumerate(rows):
                messages = _check_row(row, path, i, prompt_key)
                ids = encode_prompt(tokenizer, messages)
                index = self.num_rows
                self.num_rows += 1
                if len(ids) > max_prompt_length:
                    if filter_overlong_prompts:
                        self.num_filtered += 1
                        continue
                    if truncation == "error":
                        raise DataError(
                            f"{path} row {i}: prompt has {len(ids)} tokens > data.max_prompt_length="
                            f"{max_prompt_length}; raise max_prompt_length, set data.filter_overlong_prompts=true "
                            f"or data.truncation=left|right"
                        )
                    ids = ids[-max_prompt_length:] if truncation == "left" else ids[:max_prompt_length]
                self.items.append(
                    {
                        "prompt_ids": ids,
                        "data_source": row["data_source"],
                        "ground_truth": row["reward_model"]["ground_truth"],
                        "extra_info": row.get("extra_info") or {},
                        "index": index,
                    }
                )
        if verbose and self.num_filtered:
            print(f"[verl_lite.data] dropped {self.num_filtered}/{self.num_rows} prompts longer than "
                  f"max_prompt_length={max_prompt_length} from {self.files}")
        if not self.items:
            raise DataError(
                f"{self.files}: no prompts left ({self.num_rows} rows, {self.num_filtered} longer than "
                f"max_prompt_length={max_prompt_length}); raise data.max_prompt_length"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The item order of one epoch: a permutation drawn from Random((seed, epoch)) or range(n)."""
    order = list(range(n))
    if shuffle:
        random.Random(f"verl_lite:{seed}:{epoch}").shuffle(order)
    return order


def iterate_batches(
    dataset, batch_size: int, shuffle: bool = True, seed: int = 0, epoch: int = 0, drop_last: bool = True
) -> Iterator[list[dict[str, Any]]]:
    """Batches of `batch_size` items in the (seed, epoch) order; the last partial batch is dropped if drop_last."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    n = len(dataset)
    if drop_last and n < batch_size:
        raise DataError(f"dataset has {n} prompts < batch size {batch_size}; lower data.train_batch_size or add data")
    order = epoch_order(n, shuffle, seed, epoch)
    stop = (n // batch_size) * batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        yield [dataset[j] for j in order[start:start + batch_size]]


def num_batches(dataset, batch_size: int, drop_last: bool = True) -> int:
    n = len(dataset)
    return n // batch_size if drop_last else -(-n // batch_size)
