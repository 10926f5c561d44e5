"""transformers' lazy-import table read from a cache file instead of rebuilt from its source tree (``import
transformers`` reads every file under ``transformers/models``, about 3,300, in every process, for a table that
depends only on the installed files).

:func:`install` wraps ``define_import_structure`` as its module loads: a result is computed once, checked to survive
JSON unchanged, and stored in ``$XDG_CACHE_HOME/verl_lite/transformers-import-structure-<version>.json``. The file
holds names only, and is used only while it matches the installed transformers (version, directory, modification
times of the scanned directories); else it is rebuilt and rewritten atomically. Anything unexpected (unreadable
file, untested version, transformers already imported): the wrapper stands aside.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
from pathlib import Path

from verl_lite.compat import TESTED_VERSIONS, installed_version, is_tested

# written for and checked against define_import_structure (and the helpers it calls: create_import_structure_from_path,
# fetch__all__, spread_import_structure) of the transformers versions in compat.TESTED_VERSIONS
TARGET = "transformers.utils.import_utils"


def cache_path(version: str) -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "verl_lite" / f"transformers-import-structure-{version}.json"


def _stamp(module_path: str) -> list:
    """What the scan of ``module_path`` depends on that can change without the version changing: the directory's
    real path and the modification times of it and its sub-directories (an added, removed or renamed file)."""
    directory = os.path.realpath(module_path if os.path.isdir(module_path) else os.path.dirname(module_path))
    with os.scandir(directory) as entries:
        subdirs = sorted([e.name, e.stat().st_mtime_ns] for e in entries if e.is_dir() and e.name != "__pycache__")
    return [directory, os.stat(directory).st_mtime_ns, subdirs]


def _to_json(structure: dict) -> list:
    return [[sorted(backends), {module: sorted(names) for module, names in modules.items()}]
            for backends, modules in structure.items()]


def _from_json(entries: list) -> dict:
    return {frozenset(backends): {module: set(names) for module, names in modules.items()}
            for backends, modules in entries}


class _Cache:
    """The cache file's entries, keyed by ``define_import_structure``'s arguments."""

    def __init__(self, path: Path, version: str):
        self.path, self.version = path, version

    @functools.cached_property
    def entries(self) -> dict:
        """The file's entries, read on first use ({} for a missing, unreadable or other-version file)."""
        try:
            data = json.loads(self.path.read_text())
            entries = data["entries"] if data.get("version") == self.version else {}
            return entries if isinstance(entries, dict) else {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def get(self, key: str, stamp: list) -> dict | None:
        entry = self.entries.get(key)
        if not isinstance(entry, dict) or entry.get("stamp") != stamp:
            return None
        try:
            return _from_json(entry["structure"])
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: str, stamp: list, structure: dict) -> None:
        try:
            encoded = _to_json(structure)
        except (TypeError, AttributeError):
            return
        if _from_json(encoded) != structure:  # JSON cannot carry it exactly: never cached
            return
        self.entries[key] = {"stamp": stamp, "structure": encoded}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"version": self.version, "entries": self.entries}))
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)


def cached(define_import_structure, cache: _Cache):
    """``define_import_structure`` answered from ``cache`` where the cache matches the installed files."""

    def define_import_structure_cached(module_path, prefix=None):
        try:
            key, stamp = f"{os.fspath(module_path)}|{prefix}", _stamp(os.fspath(module_path))
        except OSError:
            return define_import_structure(module_path, prefix)
        structure = cache.get(key, stamp)
        if structure is None:
            structure = define_import_structure(module_path, prefix)
            cache.put(key, stamp, structure)
        return structure

    define_import_structure_cached.__wrapped__ = define_import_structure
    return define_import_structure_cached


class _PatchOnLoad(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads ``transformers.utils.import_utils`` as usual, then wraps its ``define_import_structure``
    before ``transformers/__init__`` (which imports it from there) calls it; removes itself after."""

    def __init__(self, cache: _Cache):
        self.cache, self.loader = cache, None

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        self.loader.exec_module(module)
        real = getattr(module, "define_import_structure", None)
        if callable(real):
            module.define_import_structure = cached(real, self.cache)


def install() -> bool:
    """Serve transformers' import table from the cache in this process (see the module docstring); True
    when the hook is in place (transformers not imported yet, the tested version installed)."""
    if "transformers" in sys.modules or any(isinstance(f, _PatchOnLoad) for f in sys.meta_path):
        return False
    version = installed_version("transformers")
    if not is_tested("transformers", version):
        return False
    sys.meta_path.insert(0, _PatchOnLoad(_Cache(cache_path(version), version)))
    return True


def describe() -> str:
    """One line on whether this process reads the table from the cache (for benchmarks' output)."""
    version = installed_version("transformers")
    if any(isinstance(f, _PatchOnLoad) for f in sys.meta_path) or (
            "transformers" in sys.modules and hasattr(getattr(sys.modules.get(TARGET), "define_import_structure", None),
                                                      "__wrapped__")):
        return f"transformers {version}: import table from the cache"
    return (f"transformers {version}: import table rebuilt by every process (the cache serves "
            f"{' / '.join(TESTED_VERSIONS['transformers'])})")
