"""verl_lite.compat.transformers_imports: transformers' lazy-import table from the cache file equals the
table transformers builds itself, and the cache is rebuilt whenever it does not match the installed files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from verl_lite.compat import TESTED_VERSIONS, is_tested
from verl_lite.compat import transformers_imports as ti

ROOT = Path(__file__).resolve().parents[2]


def _package(tmp_path: Path) -> Path:
    models = tmp_path / "models"
    (models / "alpha").mkdir(parents=True)
    (models / "beta").mkdir()
    return models


def _counting(structure: dict):
    calls = []

    def define_import_structure(module_path, prefix=None):
        calls.append((module_path, prefix))
        return {backends: {module: set(names) for module, names in modules.items()}
                for backends, modules in structure.items()}

    return define_import_structure, calls


STRUCTURE = {frozenset(): {"alpha.configuration_alpha": {"AlphaConfig"}},
             frozenset({"torch"}): {"alpha.modeling_alpha": {"AlphaModel", "AlphaForCausalLM"}}}


def test_computed_once_then_read_from_the_file(tmp_path):
    models, cache_file = _package(tmp_path), tmp_path / "cache" / "t.json"
    real, calls = _counting(STRUCTURE)
    first = ti.cached(real, ti._Cache(cache_file, "1.0"))(str(models), "models")
    assert first == STRUCTURE and len(calls) == 1 and cache_file.exists()
    again = ti.cached(real, ti._Cache(cache_file, "1.0"))(str(models), "models")  # a later process
    assert again == STRUCTURE and len(calls) == 1, "the second process rebuilt the table"
    ti.cached(real, ti._Cache(cache_file, "1.0"))(str(models), None)  # other arguments: their own entry
    assert len(calls) == 2


def test_rebuilt_when_the_files_or_the_version_change(tmp_path):
    models, cache_file = _package(tmp_path), tmp_path / "t.json"
    real, calls = _counting(STRUCTURE)
    ti.cached(real, ti._Cache(cache_file, "1.0"))(str(models), "models")
    (models / "gamma").mkdir()  # a model added
    ti.cached(real, ti._Cache(cache_file, "1.0"))(str(models), "models")
    assert len(calls) == 2
    (models / "alpha" / "tokenization_alpha.py").write_text("")  # a file added inside a model's directory
    os.utime(models / "alpha", ns=(1, 1))
    ti.cached(real, ti._Cache(cache_file, "1.0"))(str(models), "models")
    assert len(calls) == 3
    ti.cached(real, ti._Cache(cache_file, "2.0"))(str(models), "models")  # another transformers version
    assert len(calls) == 4


def test_a_damaged_or_tampered_file_is_never_trusted(tmp_path):
    models, cache_file = _package(tmp_path), tmp_path / "t.json"
    real, calls = _counting(STRUCTURE)
    cache_file.write_text("{not json")
    assert ti.cached(real, ti._Cache(cache_file, "1.0"))(str(models), "models") == STRUCTURE
    data = json.loads(cache_file.read_text())
    for entry in data["entries"].values():
        entry["stamp"] = ["/elsewhere", 0, []]
        entry["structure"] = [[[], {"evil.module": ["Thing"]}]]
    cache_file.write_text(json.dumps(data))
    assert ti.cached(real, ti._Cache(cache_file, "1.0"))(str(models), "models") == STRUCTURE
    assert len(calls) == 2


def test_what_json_cannot_carry_is_not_cached(tmp_path):
    models, cache_file = _package(tmp_path), tmp_path / "t.json"
    odd = {frozenset(): {"alpha.configuration_alpha": {"AlphaConfig", 3}}}  # an int among the names
    real, calls = _counting(odd)
    ti.cached(real, ti._Cache(cache_file, "1.0"))(str(models), None)
    ti.cached(real, ti._Cache(cache_file, "1.0"))(str(models), None)
    assert len(calls) == 2 and not cache_file.exists()


CHILD = r"""
import sys, json
import verl_lite  # installs the hook before transformers is imported
import transformers
from transformers import AutoTokenizer
from transformers.utils import import_utils
wrapped = import_utils.define_import_structure
assert hasattr(wrapped, "__wrapped__"), "the hook did not wrap define_import_structure"
import_utils.create_import_structure_from_path.cache_clear()
data = json.load(open(sys.argv[1]))
mismatch = []
for key in data["entries"]:
    path, prefix = key.rsplit("|", 1)
    prefix = None if prefix == "None" else prefix
    if wrapped(path, prefix) != wrapped.__wrapped__(path, prefix):
        mismatch.append(key)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
from verl_lite.compat.transformers_imports import describe
print(json.dumps({"entries": len(data["entries"]), "mismatch": mismatch, "vocab": len(tokenizer), "said": describe()}))
"""


def test_the_real_table_from_the_cache_equals_transformers_own(tmp_path, monkeypatch):
    """Two processes: the first builds and writes the table, the second reads it; in both, every cached table
    equals the one transformers' own function builds, and a tokenizer loads through the lazy modules."""
    import transformers

    if not is_tested("transformers", transformers.__version__):
        import pytest

        pytest.skip(f"the hook is written for transformers {' / '.join(TESTED_VERSIONS['transformers'])}; "
                    f"{transformers.__version__} is installed")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache_file = ti.cache_path(transformers.__version__)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", CHILD, str(cache_file), str(ROOT / "verl_lite/assets/tiny-addition")],
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["entries"] >= 2 and out["mismatch"] == [] and out["vocab"] > 0, out
        assert out["said"].endswith("import table from the cache"), out


def test_another_transformers_version_is_left_to_build_its_own_table(tmp_path):
    """A transformers version the hook was not checked against (a shadowing dist-info): no hook, and
    describe() says the table is rebuilt, naming the versions the cache serves."""
    site = tmp_path / "site" / "transformers-9.9.9.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 9.9.9\n")
    code = ("import sys, verl_lite\nfrom verl_lite.compat import transformers_imports as t\n"
            "assert not any(isinstance(f, t._PatchOnLoad) for f in sys.meta_path)\nprint(t.describe())")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site.parent), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout.strip()
    assert said.startswith("transformers 9.9.9: import table rebuilt") and TESTED_VERSIONS["transformers"][-1] in said, said
