"""verl_lite.compat: the shims are pinned to the versions they were written for.

- pyproject.toml pins each package of ``compat.PINNED`` to exactly the versions ``compat.TESTED_VERSIONS`` names
  (``compat.pinned_specifier``), and the table's rules hold (a series takes its local builds, not its neighbours);
- with another version installed (a shadowing ``*.dist-info`` on PYTHONPATH, i.e. the pins bypassed),
  the CLI fails at the first shim with one line naming the package and the tested version, before
  anything starts (exit 2).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from verl_lite.compat import PINNED, TESTED_VERSIONS, is_tested, pinned_specifier

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_pins_the_tested_versions():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {}
    for dep in deps:
        req = Requirement(dep)
        pins[req.name] = req.specifier
    for package in PINNED:
        assert pins.get(package) == SpecifierSet(pinned_specifier(package)), (package, str(pins.get(package)))


def test_the_specifier_admits_exactly_the_tested_versions():
    """pip's reading of each pin and :func:`is_tested` agree: the tested releases and series (with local builds)
    are in, their neighbours are out."""
    cases = {"torch": ["2.10.0", "2.11.0", "2.11.3+cu130", "2.12.0", "2.13.0+cpu", "2.13.1", "2.14.0", "3.13.0"],
             "megatron-core": ["0.16.0", "0.16.1", "0.16.2", "0.17.1"], "ray": ["2.59.0", "2.60.0", "2.60.1"]}
    for package, versions in cases.items():
        spec = SpecifierSet(pinned_specifier(package))
        admitted = [v for v in versions if spec.contains(v, prereleases=False)]
        assert admitted == [v for v in versions if is_tested(package, v)], package
    assert [v for v in cases["torch"] if is_tested("torch", v)] == ["2.11.0", "2.11.3+cu130", "2.13.0+cpu", "2.13.1"]
    assert not is_tested("torch", "2.130.0") and not is_tested("torch", None)


def _untested_version(package: str) -> str:
    """A version next to the last tested one (a series gets its .0)."""
    last = TESTED_VERSIONS[package][-1].split(".")
    bumped = [*last[:-1], str(int(last[-1]) + 1)]
    return ".".join(bumped + ["0"] * (3 - len(bumped)))


def _fake_install(tmp_path: Path, package: str, version: str) -> Path:
    site = tmp_path / "site"
    info = site / f"{package.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    return site


@pytest.mark.parametrize("package", PINNED)
def test_other_version_fails_at_first_shim_with_one_line(tmp_path, package):
    other = _untested_version(package)
    site = _fake_install(tmp_path, package, other)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "verl_lite.trainer.main_ppo", "trainer.total_training_steps=1",
         f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.output_dir={tmp_path / 'out'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("verl_lite:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert f"{package}{pinned_specifier(package)}" in lines[0] and other in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
