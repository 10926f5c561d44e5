"""verl_lite.compat: the shims are pinned to the versions they were written for.

- pyproject.toml pins exactly the versions ``compat.TESTED_VERSIONS`` names;
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

from verl_lite.compat import TESTED_VERSIONS

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_pins_the_tested_versions():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {}
    for dep in deps:
        req = Requirement(dep)
        pins[req.name] = str(req.specifier)
    for package, version in TESTED_VERSIONS.items():
        assert pins.get(package) == f"=={version}", (package, pins.get(package))


def _fake_install(tmp_path: Path, package: str, version: str) -> Path:
    site = tmp_path / "site"
    info = site / f"{package.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
    return site


@pytest.mark.parametrize("package", sorted(TESTED_VERSIONS))
def test_other_version_fails_at_first_shim_with_one_line(tmp_path, package):
    tested = TESTED_VERSIONS[package]
    other = tested.rsplit(".", 1)[0] + "." + str(int(tested.rsplit(".", 1)[1]) + 1)
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
    assert f"{package}=={tested}" in lines[0] and other in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
