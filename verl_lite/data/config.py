"""The data section (verl's ``data.*``): its fields, defaults and rules, stated once here."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

TRUNCATIONS = ("error", "left", "right")


@dataclass
class DataConfig:
    train_files: Any = None  # str or list of parquet paths; None = built-in synthetic task (train split)
    val_files: Any = None  # str or list of parquet paths; [] = no validation; None = the built-in val split with the built-in train files, else []
    prompt_key: str = "prompt"  # column holding the chat messages
    reward_fn_key: str = "data_source"  # column holding each row's data source, the reward's first argument
    max_prompt_length: int = 16  # tokens, after the chat template
    max_response_length: int = 12  # tokens generated at most (EOS included)
    train_batch_size: int = 16  # prompts per RL step
    val_batch_size: Optional[int] = None  # prompts per validation generate call; None = all at once
    filter_overlong_prompts: bool = False  # drop prompts longer than max_prompt_length (else see truncation)
    truncation: str = "error"  # overlong prompt when not filtered: error | left | right
    shuffle: bool = True  # reshuffle the prompts every epoch (seeded by data.seed)
    seed: int = 0  # data order seed

    def problems(self) -> list[str]:
        """``data.truncation`` is a known mode; ``data.train_files``/``val_files`` name existing files."""
        p = []
        if self.truncation not in TRUNCATIONS:
            p.append(f"data.truncation={self.truncation!r} is unknown; choose one of {list(TRUNCATIONS)}")
        for key in ("train_files", "val_files"):
            files = getattr(self, key)
            files = [files] if isinstance(files, str) else list(files or [])
            if not files and key == "train_files":  # no val_files: no validation
                p.append(f"data.{key} is empty; give one or more parquet files (or null for the built-in task)")
            p.extend(f"data.{key}: {f!r} is a directory; list its parquet files (data.{key}='[{f}/a.parquet,...]')"
                     if Path(f).is_dir() else f"data.{key}: {f!r} does not exist; give an existing parquet file"
                     for f in files if not Path(f).is_file())
        return p
