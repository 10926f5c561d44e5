"""scripts/config_docs.py (the generator of docs/config.md's tables, a developer tool outside the package) as a module."""

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "config_docs.py"
_spec = importlib.util.spec_from_file_location("config_docs", _PATH)
docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs)
