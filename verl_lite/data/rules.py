"""The data section's rules, stated once here and collected by ``verl_lite.config.validate``.

    data_problems(data_section) -> list[str]   # one line per problem, naming the key
"""

from __future__ import annotations

from pathlib import Path

from verl_lite.data.dataset import TRUNCATIONS


def data_problems(d) -> list[str]:
    """``data.truncation`` is a known mode; ``data.train_files``/``val_files`` name existing files."""
    p = []
    if d.truncation not in TRUNCATIONS:
        p.append(f"data.truncation={d.truncation!r} is unknown; choose one of {list(TRUNCATIONS)}")
    for key in ("train_files", "val_files"):
        files = getattr(d, key)
        files = [files] if isinstance(files, str) else list(files or [])
        if not files and key == "train_files":  # no val_files: no validation
            p.append(f"data.{key} is empty; give one or more parquet files (or null for the built-in task)")
        p.extend(f"data.{key}: {f!r} is a directory; list its parquet files (data.{key}='[{f}/a.parquet,...]')"
                 if Path(f).is_dir() else f"data.{key}: {f!r} does not exist; give an existing parquet file"
                 for f in files if not Path(f).is_file())
    return p
