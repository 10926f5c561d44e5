"""verl's own example scripts through pre-flight: every problem is reported in ONE run.

``verl_scripts/`` keeps five of verl's megatron scripts unchanged (volcengine/verl at b178a3c,
Apache-2.0): GRPO and PPO on Qwen2-7B, DAPO (one-step-off recipe, colocated), GRPO on Qwen3-30B-A3B
(MoE) and GRPO with LoRA. bash runs each with ``python3`` replaced by a function that prints its
arguments, so the overrides are exactly what the script passes (its variables expanded), and the
``python3 -m verl.trainer.main_ppo --config-path/--config-name`` head is dropped.

Per script, with the data files and the model it names made local as a user would (the data at the
paths it names, the tiny model at the model directory it names, or in the HF cache under the hub id
it names, as a download would leave it; offline):
1. one pre-flight (``load_config(overrides, problems)`` + ``PPOTrainer``, in process: no Ray, no
   worker) must fail with one error listing every problem, each naming a key of the script;
2. the keys named there are dropped and pre-flight runs again, until it passes (the trainer is
   built). Every problem of a later round must name a key dropped before it (it is a consequence of
   the drop, e.g. the rollout falls back to ``hf`` and the script's vLLM settings no longer apply).
   A problem naming only keys the first run had unchanged was there all along: reported in stages,
   which is what a DAPO script needed 3 runs for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from verl_lite.config import ConfigError, default_data_files, default_model_path, load_config

SCRIPTS = Path(__file__).resolve().parent / "verl_scripts"
SCRIPT_NAMES = sorted(p.name for p in SCRIPTS.glob("*.sh"))
EXTRACT = """python3() { printf '%s\\0' "$@"; exit 0; }
python() { python3 "$@"; }
script=$1; shift
source "$script"
"""


def script_overrides(script: Path, home: Path, env: dict) -> list[str]:
    """The overrides ``script`` passes to verl's main_ppo (bash expands its variables; HOME = ``home``)."""
    out = subprocess.run(["bash", "-c", EXTRACT, "extract", str(script)], capture_output=True, timeout=60,
                         env={"PATH": os.environ["PATH"], "HOME": str(home), **env}, cwd=home)
    args = out.stdout.decode().split("\0")[:-1]
    assert args[:2] == ["-m", "verl.trainer.main_ppo"], f"{script.name}: not a main_ppo command: {args[:3]}"
    return [a for a in args[2:] if not a.startswith("--config-")]


def _cache_hub_model(repo_id: str, cache: Path) -> None:
    """The tiny model where ``snapshot_download(repo_id)`` finds it offline (huggingface_hub's cache layout)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    if not repo.exists():
        shutil.copytree(default_model_path(), repo / "snapshots" / ("0" * 40))
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text("0" * 40)


def _local_files(overrides: list[str], home: Path) -> None:
    """Put the shipped data at every .parquet path and the tiny model at every model path or hub id the
    script names (what a user does before running it)."""
    train, _ = default_data_files()
    for item in overrides:
        key, _, value = item.partition("=")
        for path in value.strip("[]").replace("'", "").replace('"', "").split(","):
            path = path.strip()
            if path.endswith(".parquet") and path.startswith(str(home)):
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(train[0], path)
            elif key.endswith("model.path") and path.startswith(str(home)) and not Path(path).exists():
                shutil.copytree(default_model_path(), path)
            elif key.endswith("model.path") and not path.startswith("/"):
                _cache_hub_model(path, home / "hub")


def preflight_problems(overrides: list[str]) -> list[str]:
    """Every problem one pre-flight finds (none: [])."""
    from verl_lite.config.loader import Problems
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    problems = Problems()
    try:
        cfg = load_config(overrides, problems)
        trainer = PPOTrainer(cfg, problems=problems)
    except ConfigError as e:
        return e.problems
    except Exception as e:  # noqa: BLE001 - a bad-input error of one stage alone
        if getattr(e, "exit_code", None) == 2:
            return [str(e)]
        raise
    trainer.reward_manager.close()
    return []


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_a_verl_script_gets_every_problem_in_one_run(name, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    env = {"MODEL_PATH": str(home / "models" / "model"), "RAY_DATA_HOME": str(home / "verl")}
    monkeypatch.chdir(home)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    overrides = script_overrides(SCRIPTS / name, home, env)
    _local_files(overrides, home)

    first = preflight_problems(overrides)
    assert first, f"{name}: pre-flight found nothing, but the script asks for GPUs/sizes this machine lacks"
    keys = [item.partition("=")[0].lstrip("+") for item in overrides]
    unnamed = [line for line in first if not any(key in line for key in keys)]
    assert not unnamed, f"{name}: problems that name no key of the script:\n" + "\n".join(unnamed)

    dropped: set[str] = set()
    found = first
    for _ in range(4):
        dropped |= {key for key in keys if any(key in line for line in found)}
        found = preflight_problems([item for item, key in zip(overrides, keys) if key not in dropped])
        hidden = [line for line in found if not any(key in line for key in dropped)]
        assert not hidden, (f"{name}: found only after the first run's keys were dropped (reported in stages):\n"
                            + "\n".join(hidden) + "\n\nfirst run:\n" + "\n".join(first))
        if not found:
            return
    raise AssertionError(f"{name}: still failing after dropping {sorted(dropped)}:\n" + "\n".join(found))
