"""Prompt datasets: verl's parquet rows or TRL-style rows (a chat prompt gets the chat template, a plain-text one is
tokenized as it is; every other column reaches ``extra_info``), with the overlong-prompt filter
(docs/python_api.md, "Rows").

Item i of :class:`RLDataset` is {"prompt_ids", "data_source", "ground_truth" (or None), "extra_info", "index"
(the row's position in the concatenated files), "messages" (the prompt as given)}.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Iterator, Sequence

from verl_lite.data.config import TRUNCATIONS, DataConfig


class DataError(ValueError):
    """A dataset file or row is not in the expected format; the message names file, row and fix."""

    exit_code, describe_prefix = 2, "bad data: "  # verl_lite.errors.describe


def _read_rows(path: Path, prompt_key: str) -> list[dict]:
    import pyarrow.parquet as pq

    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist")
    try:
        table = pq.ParquetFile(path).read()  # one file; read_table would import pyarrow.dataset and pandas, unused here
    except Exception as e:
        hint = {".jsonl": "pandas.read_json(f, lines=True)", ".json": "pandas.read_json(f)",
                ".csv": "pandas.read_csv(f)"}.get(Path(path).suffix.lower())
        convert = f"; convert it: {hint}.to_parquet('out.parquet')" if hint else ""
        raise DataError(f"{path}: cannot be read as parquet ({type(e).__name__}: {e}){convert}") from e
    if prompt_key not in table.column_names:
        raise DataError(
            f"{path}: missing column(s) {[prompt_key]}; found {table.column_names}. Rows need "
            f"'{prompt_key}' (chat messages or plain text); set data.prompt_key if the prompt column has another name"
        )
    return table.to_pylist()


def _check_prompt(prompt, where: str, prompt_key: str) -> list[dict] | str:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: '{prompt_key}' is empty; give the prompt text or drop the row")
        return prompt
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DataError(f"{where}: '{prompt_key}' must be plain text or a non-empty list of chat messages "
                        f"[{{'role': 'user', 'content': ...}}], got {prompt!r}")
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {j} of '{prompt_key}' must be {{'role': str, 'content': str}}, got {m!r}")
    if not any(m["content"].strip() for m in prompt):
        raise DataError(f"{where}: every message of '{prompt_key}' has empty content; give the prompt text or drop the row")
    return list(prompt)


IN_MEMORY = "<in-memory dataset>"
DEFAULT_DATA_SOURCE = "python"
VERL_ROW_KEYS = ("data_source", "reward_model", "extra_info")


def _normalize_row(row: dict, where: str, prompt_key: str, data_source_key: str = "data_source") -> dict:
    """Any accepted row (docs/python_api.md, "Rows") as {"messages" (the prompt), data_source, ground_truth,
    extra_info}; the data source (what the reward dispatches on) is read from column ``data_source_key``
    (``data.reward_fn_key``). A bad row raises DataError naming file and row."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: rows must be dicts, got {type(row).__name__}")
    if prompt_key not in row:
        raise DataError(f"{where}: no {prompt_key!r} key (keys: {sorted(row)}); set data.prompt_key if the prompt "
                        f"has another name")
    reward_model = row.get("reward_model")
    if reward_model is not None and not isinstance(reward_model, dict):
        raise DataError(f"{where}: 'reward_model' must be a dict ({{'ground_truth': ...}}) or absent, got "
                        f"{reward_model!r}")
    truth = (reward_model or {}).get("ground_truth")
    if truth is None:
        truth = row.get("ground_truth")
    columns = {k: v for k, v in row.items() if k not in (prompt_key, "ground_truth", *VERL_ROW_KEYS)}
    if data_source_key != "data_source" and data_source_key not in row:
        raise DataError(f"{where}: no {data_source_key!r} column (data.reward_fn_key) for the reward to dispatch on "
                        f"(keys: {sorted(row)}); set data.reward_fn_key to a column of the data")
    messages = _check_prompt(row[prompt_key], where, prompt_key)
    source = row.get(data_source_key)
    if source is not None and not isinstance(source, str):
        raise DataError(f"{where}: 'data_source' must be a string, got {source!r}")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DataError(f"{where}: 'extra_info' must be a dict or null, got {type(extra).__name__}")
    return {"messages": messages, "data_source": DEFAULT_DATA_SOURCE if source is None else source,
            "ground_truth": truth, "extra_info": {**(extra or {}), **columns}}


def _sources(files) -> list[tuple[str, list[dict]]]:
    """(name, rows) per source: parquet path(s), a list of dicts, or an HF ``datasets.Dataset``."""
    if hasattr(files, "to_list") and not isinstance(files, (str, Path)):  # datasets.Dataset
        files = files.to_list()
    if isinstance(files, (list, tuple)) and files and all(isinstance(r, dict) for r in files):
        return [(IN_MEMORY, list(files))]
    files = [files] if isinstance(files, (str, Path)) else list(files)
    return [(str(f), None) for f in files]


def encode_prompt(tokenizer, messages: list[dict] | str, tools: list[dict] | None = None) -> list[int]:
    """Chat template with the generation prompt, tokenized without adding special tokens twice; a
    plain-text prompt is tokenized as it is (no template, no special tokens added: TRL's rule).
    ``tools`` (OpenAI function schemas, multi-turn rollouts) go to the template's ``tools=``."""
    return tokenizer.encode(render_prompt(tokenizer, messages, tools), add_special_tokens=False)


def render_prompt(tokenizer, messages: list[dict] | str, tools: list[dict] | None = None) -> str:
    """The prompt's text as the model reads it (:func:`encode_prompt` before tokenizing)."""
    return messages if isinstance(messages, str) else tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **({"tools": tools} if tools else {}))


CHAT_ROLES = ("system", "user", "assistant", "tool")


def _check_rendered(messages: list[dict] | str, text: str, where: str, prompt_key: str) -> None:
    """A message of a role the chat template does not know (``'usr'``) is dropped by many templates without a
    word, leaving a prompt without its question: refused here, naming the role."""
    if isinstance(messages, str):
        return
    for j, m in enumerate(messages):
        content = m["content"].strip()
        if m["role"] not in CHAT_ROLES and content and content not in text:
            raise DataError(f"{where}: message {j} of '{prompt_key}' has role {m['role']!r}, which the tokenizer's "
                            f"chat template drops (its content is not in the rendered prompt); use one of "
                            f"{list(CHAT_ROLES)}")


class RLDataset:
    """Every row checked and its prompt tokenized. Prompts longer than ``max_prompt_length`` are dropped with
    ``filter_overlong_prompts`` (counted in ``num_filtered``), else ``truncation`` says: "error" raises naming the
    file and row, "left" keeps the last tokens, "right" the first. Its defaults are the ``data`` section's."""

    @classmethod
    def from_config(cls, data: DataConfig, files, tokenizer, tools: list[dict] | None = None) -> RLDataset:
        """The data set of ``files`` read as the ``data`` section says (keys, prompt length, overlong prompts)."""
        return cls(files, tokenizer, data.max_prompt_length, prompt_key=data.prompt_key,
                   data_source_key=data.reward_fn_key, filter_overlong_prompts=data.filter_overlong_prompts,
                   truncation=data.truncation, tools=tools)

    def __init__(
        self,
        files: str | Sequence[str] | Sequence[dict],
        tokenizer,
        max_prompt_length: int,
        prompt_key: str = DataConfig.prompt_key,
        data_source_key: str = DataConfig.reward_fn_key,  # the column the reward dispatches on
        filter_overlong_prompts: bool = DataConfig.filter_overlong_prompts,
        truncation: str = DataConfig.truncation,
        verbose: bool = True,
        tools: list[dict] | None = None,  # tool schemas rendered into every prompt (multi-turn rollouts)
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
        self.rows_without_ground_truth: list[str] = []
        for f, memory_rows in sources:
            path = Path(f)
            rows = _read_rows(path, prompt_key) if memory_rows is None else memory_rows
            for i, row in enumerate(rows):
                where = f"{path} row {i}"
                row = _normalize_row(row, where, prompt_key, data_source_key)
                if row["ground_truth"] is None:
                    self.rows_without_ground_truth.append(where)
                text = render_prompt(tokenizer, row["messages"], tools)
                _check_rendered(row["messages"], text, where, prompt_key)
                ids = tokenizer.encode(text, add_special_tokens=False)
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
                self.items.append({"prompt_ids": ids, "data_source": row["data_source"],
                                   "ground_truth": row["ground_truth"], "extra_info": row["extra_info"],
                                   "index": index, "messages": row["messages"]})
        if verbose and self.num_filtered:
            print(f"[verl_lite.data] dropped {self.num_filtered}/{self.num_rows} prompts longer than "
                  f"max_prompt_length={max_prompt_length} from {self.files}")
        if not self.num_rows:
            raise DataError(f"{self.files}: no rows; give files with at least one prompt")
        if not self.items:
            raise DataError(
                f"{self.files}: no prompts left ({self.num_rows} rows, {self.num_filtered} longer than "
                f"max_prompt_length={max_prompt_length}); raise data.max_prompt_length"
            )

    @property
    def columns(self) -> list[str]:
        """The extra_info keys every item has: the row fields a reward function can read by name."""
        keys = [set(it["extra_info"]) for it in self.items]
        return sorted(set.intersection(*keys)) if keys else []

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
    """Batches of `batch_size` items in the (seed, epoch) order, the same on every process; the last partial
    batch is dropped if drop_last."""
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
