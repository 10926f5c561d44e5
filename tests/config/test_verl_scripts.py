"""verl's own example scripts through pre-flight: every problem is reported in ONE run, and what runs keeps its meaning.

``verl_scripts/`` keeps thirteen of verl's scripts (volcengine/verl at b178a3c, Apache-2.0). Five megatron ones are
unchanged: GRPO and PPO on Qwen2-7B, DAPO (colocated), GRPO on Qwen3-30B-A3B (MoE) and GRPO with LoRA (TP 4 over 2
KV heads: refused). The other eight, with the megatron LoRA one the nine scripts of issue 50's review, have only
paths, sizes and GPU counts changed for a 2-core CPU machine (each file's header lists its changes): four multi-turn
(``examples/sglang_multiturn``: GRPO with the gsm8k tool, its megatron variant, the gsm8k interaction, the tool
agent), two LoRA (``run_qwen2_5-3b_gsm8k_grpo_lora.sh``, ``qwen2-0.5b_grpo-lora_1_h100_fsdp_vllm.sh``) and two
one-step-off (``one_step_off_policy/shell``). The verl YAMLs they name (``--config-name``, tool and interaction
configs) are kept under ``examples/`` and ``verl/`` as in a verl checkout; ``ported/`` holds verl's gsm8k tool and
interaction as a user ports them (what the pre-flight's hint for a ``verl.*`` class says).

Per script, in a fresh working directory (the user's checkout: those folders copied in), with the data files and
the model it names made local as a user would (the data at the paths it names, the shipped tiny tool-agent model at
the model directory it names, or in the HF cache under the hub id it names, as a download would leave it; offline):
1. bash runs it with ``python3`` replaced by a function that prints its arguments (its variables expanded); the head
   is verl's entry point (``ENTRY_POINTS``) and its ``--config-path/--config-name`` go to verl_lite's main_ppo as
   given (``expand_recipes``: a verl config of one's own is read first). A relative ``--config-path`` is the entry
   module's folder's, as Hydra reads it; an entry point's own config (verl's ``@hydra.main`` default) is named when
   the script names none. A one-step-off entry point is run as ``python -m verl_lite.trainer.main_ppo`` with the
   same keys: its scripts set ``actor_rollout_ref.hybrid_engine=false``, which is one-step-off here (lag 1).
2. one pre-flight (``load_config`` + ``PPOTrainer``, in process: no Ray, no worker) must name every problem, each
   naming a key of the script, or a file it names (its config YAML, a tool / interaction YAML), and saying why (no
   verl key gets the generic unknown-key line);
3. the user fixes what the lines name: a script key is dropped, a config YAML's key is deleted from the file, a verl
   class (``verl.tools.*``, ``verl.interactions.*``) is pointed at its port; pre-flight runs again until it passes.
   Every problem of a later round must name something fixed before it (a consequence, e.g. the rollout falls back
   to ``hf`` and the script's vLLM settings no longer apply). One naming only what the first run had unchanged was
   there all along: reported in stages;
4. the built trainer keeps the script's meaning: every kept key's value is the config's (verl's names through their
   aliases), and the per-script checks of ``MEANING`` hold (LoRA rank/alpha, tools loaded, one step off).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from operator import attrgetter
from pathlib import Path

import pytest
import yaml

from verl_lite.config import ConfigError, default_data_files, load_config
from verl_lite.config.loader import ASSETS_DIR, RECIPE, schema_keys
from verl_lite.config.verl_keys import decide
from verl_lite.trainer.main_ppo import expand_recipes

SCRIPTS = Path(__file__).resolve().parent / "verl_scripts"
SCRIPT_NAMES = sorted(p.name for p in SCRIPTS.glob("*.sh"))
MODEL = ASSETS_DIR / "tool-agent"  # the shipped tiny model whose chat template renders tool and user turns, as Qwen's
CHECKOUT = ("examples", "verl", "ported")  # what the scripts find in their working directory (a verl checkout)
# verl's entry points -> the config its @hydra.main composes when the script names none (None: verl's trainer config)
ENTRY_POINTS = {"verl.trainer.main_ppo": None,
                "verl.experimental.one_step_off_policy.main_ppo": "one_step_off_ppo_trainer",
                "recipe.one_step_off_policy.main_ppo": "one_step_off_ppo_trainer"}
EXTRACT = """exec 3>&1 >/dev/null 2>&1
python3() { printf '%s\\0' "$@" >&3; exit 0; }
python() { python3 "$@"; }
ulimit() { :; }
script=$1; shift
source "$script"
"""


def script_command(script: Path, home: Path, env: dict) -> tuple[str, list[str]]:
    """(verl's entry module, the arguments ``script`` passes it) (bash expands its variables; HOME = ``home``)."""
    out = subprocess.run(["bash", "-c", EXTRACT, "extract", str(script)], capture_output=True, timeout=60,
                         env={"PATH": os.environ["PATH"], "HOME": str(home), **env}, cwd=home)
    args = out.stdout.decode().split("\0")[:-1]
    assert args[:1] == ["-m"] and args[1] in ENTRY_POINTS, f"{script.name}: not a verl entry point: {args[:3]}"
    return args[1], args[2:]


def verl_lite_command(module: str, args: list[str]) -> list[str]:
    """The arguments for ``python -m verl_lite.trainer.main_ppo``: a relative ``--config-path`` made the entry
    module's folder's (Hydra's reading), the entry point's own config named where the script names none."""
    path, name, rest, i = None, None, [], 0
    while i < len(args):
        flag, _, value = args[i].partition("=")
        if flag in ("--config-path", "--config-name") and not value:
            value, i = args[i + 1], i + 1
        if flag == "--config-path":
            path = value
        elif flag == "--config-name":
            name = value
        else:
            rest.append(args[i])
        i += 1
    if name is None and ENTRY_POINTS[module] is not None:
        path, name = "config", ENTRY_POINTS[module]
    if name is None:
        return rest
    module_dir = Path(*module.split(".")[:-1])
    path = path if Path(path or "config").is_absolute() else str(module_dir / (path or "config"))
    return [f"--config-path={path}", f"--config-name={name}", *rest]


def _cache_hub_model(repo_id: str, cache: Path) -> None:
    """The tiny model where ``snapshot_download(repo_id)`` finds it offline (huggingface_hub's cache layout)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    if not repo.exists():
        shutil.copytree(MODEL, repo / "snapshots" / ("0" * 40))
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
                shutil.copytree(MODEL, path)
            elif key.endswith("model.path") and not path.startswith("/"):
                _cache_hub_model(path, home / "hub")


def preflight(argv: list[str]):
    """One pre-flight of main_ppo's command line ``argv``: (every problem it finds, the trainer when none)."""
    from verl_lite.config.loader import Problems
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    problems = Problems()
    try:
        cfg = load_config(expand_recipes(argv), problems)
        trainer = PPOTrainer(cfg, problems=problems)
    except ConfigError as e:
        return e.problems, None
    except Exception as e:  # noqa: BLE001 - a bad-input error of one stage alone
        if getattr(e, "exit_code", None) == 2:
            return [str(e)], None
        raise
    trainer.reward_manager.close()
    return [], trainer


def names(line: str, name: str) -> bool:
    """Whether a problem line names the dotted key or file ``name`` (not as a part of a longer key)."""
    return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", line) is not None


def _leaves(node, prefix: str = "") -> list[str]:
    """The dotted keys of a YAML mapping's leaves."""
    if not isinstance(node, dict):
        return [prefix.rstrip(".")]
    return [key for name, value in node.items() for key in _leaves(value, f"{prefix}{name}.")]


def _delete(node: dict, key: str) -> None:
    """``key`` out of a YAML mapping, with the sections it leaves empty (as a user deletes a setting)."""
    head, _, rest = key.partition(".")
    if rest:
        _delete(node[head], rest)
    if not rest or not node[head]:
        del node[head]


class UserFixes:
    """What the user changes as the lines ask: script keys dropped, config-YAML keys deleted, verl classes in tool /
    interaction YAMLs pointed at their ports (``ported/``). ``fixed`` = every name a later line may blame."""

    def __init__(self, argv: list[str], home: Path):
        self.config = [a for a in argv if a.startswith("--config-")]  # verl's --config-path / --config-name
        self.overrides = [a for a in argv if not a.startswith("--config-")]
        self.home, self.fixed = home, set()
        self.keys = [item.partition("=")[0].lstrip("+") for item in self.overrides]

    def config_files(self) -> list[Path]:
        """The verl config YAML the command line names (``--config-path/--config-name``), as named (cwd: home)."""
        return [Path(a[len(RECIPE):]) for a in expand_recipes(self.argv()) if a.startswith(RECIPE)]

    def named_files(self) -> list[Path]:
        """The YAML files the script's values name (tool and interaction configs) in the user's checkout."""
        found = [Path(v) for item in self.overrides for v in [item.partition("=")[2].strip("'\"")]
                 if v.endswith((".yaml", ".yml"))]
        return [f for f in found if f.is_file() and self.home in f.resolve().parents]

    def argv(self) -> list[str]:
        """The command line as the user runs it now."""
        return self.config + self.kept()

    def kept(self) -> list[str]:
        return [item for item, key in zip(self.overrides, self.keys) if key not in self.fixed]

    def unnamed(self, lines: list[str]) -> list[str]:
        """The lines that name no key of the script and no file it names."""
        files = [str(f) for f in self.config_files() + self.named_files()]
        return [line for line in lines if not any(names(line, n) for n in self.keys + files)]

    def apply(self, lines: list[str]) -> None:
        """Each line's fix: its verl classes ported, or else its script keys dropped and its config-YAML keys
        deleted."""
        ported = {cls for file in self.named_files() for cls in self._port(file, lines)}
        self.fixed |= ported
        lines = [line for line in lines if not any(cls in line for cls in ported)]
        self.fixed |= {key for key in self.keys if any(names(line, key) for line in lines)}
        for file in self.config_files():
            mine = [line for line in lines if names(line, str(file))]
            data = yaml.safe_load(file.read_text())
            for key in [k for k in _leaves(data) if any(names(line, k) for line in mine)]:
                _delete(data, key)
                self.fixed.add(key)
            file.write_text(yaml.safe_dump(data))

    @staticmethod
    def _port(file: Path, lines: list[str]) -> list[str]:
        """The verl classes of a tool / interaction YAML that the lines say need verl, pointed at their ports."""
        data, done = yaml.safe_load(file.read_text()), []
        for entry in data.get("tools") or data.get("interaction") or []:
            cls = entry.get("class_name", "")
            if any(cls in line and "verl is not installed" in line for line in lines if names(line, str(file))):
                entry["class_name"] = "ported." + ".".join(cls.split(".")[-2:])
                done.append(cls)
        file.write_text(yaml.safe_dump(data))
        return done


def _parsed(item: str):
    """An override's value as Hydra parses it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(overrides=[item])[0].value()


def changed_values(cfg, overrides: list[str]) -> list[str]:
    """Kept scalar overrides (numbers, booleans, names: not paths) whose value the built config does not hold."""
    keys, out = schema_keys(), []
    for item in overrides:
        key, value = item.partition("=")[0].lstrip("+"), _parsed(item)
        decision = decide(key, value) if key not in keys else None
        target, value = (decision.target, decision.value) if decision and decision.kind == "alias" else (key, value)
        if keys.get(target) != "leaf" or not isinstance(value, (bool, int, float, str)) or "/" in str(value):
            continue
        held = attrgetter(target)(cfg)
        if held != value and not (isinstance(held, str) and held.lower() == str(value).lower()):
            out.append(f"{item}: the config holds {target}={held!r}")
    return out


def _tool_names(trainer) -> list[str]:
    return [schema["function"]["name"] for schema in trainer.agent.tool_schemas]


def _one_step_off(trainer) -> None:
    """The run's rollout source is the fixed one-step-off schedule (rollout_sources.open_rollout_source: a rollout
    pool of its own, not separate_async, staleness 1), not the synchronous colocated one."""
    cfg = trainer.cfg
    assert not cfg.actor_rollout_ref.hybrid_engine and cfg.trainer.v1.trainer_mode == "sync"
    assert cfg.async_training.staleness_threshold == 1, cfg.async_training
    assert cfg.actor_rollout_ref.rollout.n_gpus_per_node == 1  # verl's rollout.n_gpus_per_node: the pool's size


def _gsm8k_tool(trainer) -> None:
    mt = trainer.cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.max_assistant_turns == 5  # the script's verl YAML
    assert _tool_names(trainer) == ["calc_gsm8k_reward"]


def _gsm8k_interaction(trainer) -> None:
    mt = trainer.cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.max_user_turns == 5 and mt.interaction_config_path


def _lora(rank: int, alpha: int):
    def check(trainer) -> None:
        lora = trainer.cfg.actor_rollout_ref.model.lora
        assert (lora.rank, lora.alpha) == (rank, alpha), lora
    return check


MEANING = {  # what each script asks for, held by the built trainer (beyond every kept key's value)
    "run_qwen2.5-3b_gsm8k_multiturn.sh": [_gsm8k_tool],
    "run_qwen2.5-3b_megatron_gsm8k_multiturn.sh": [_gsm8k_tool],
    "run_qwen2.5-3b_gsm8k_tool_agent_mlflow.sh": [_gsm8k_tool],
    "run_qwen2.5-0.5b_gsm8k_multiturn_w_interaction.sh": [_gsm8k_interaction],
    "run_qwen2_5-3b_gsm8k_grpo_lora.sh": [_lora(64, 32)],
    "qwen2-0.5b_grpo-lora_1_h100_fsdp_vllm.sh": [_lora(32, 32)],
    "dapo_7b_math_megatron_4_12.sh": [_one_step_off],
    "grpo_0.6b_gsm8k_fsdp2_2_6.sh": [_one_step_off],
}


@pytest.mark.parametrize("name", SCRIPT_NAMES)
def test_a_verl_script_gets_every_problem_in_one_run(name, tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    for part in CHECKOUT:
        shutil.copytree(SCRIPTS / part, home / part, ignore=shutil.ignore_patterns("__pycache__"))
    env = {"MODEL_PATH": str(home / "models" / "model"), "RAY_DATA_HOME": str(home / "verl")}
    monkeypatch.chdir(home)
    monkeypatch.syspath_prepend(str(home))  # the ported classes, importable as the user's own modules
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    module, args = script_command(SCRIPTS / name, home, env)
    fixes = UserFixes(verl_lite_command(module, args), home)
    _local_files(fixes.overrides, home)

    first, trainer = preflight(fixes.argv())
    unnamed = fixes.unnamed(first)
    assert not unnamed, f"{name}: problems that name no key of the script:\n" + "\n".join(unnamed)
    why_not = [line for line in first if "unknown config key" in line]  # a verl key is refused with its reason
    assert not why_not, f"{name}: verl keys refused without a reason:\n" + "\n".join(why_not)
    found = first
    for _ in range(4):
        if trainer is not None:
            break
        fixes.apply(found)
        found, trainer = preflight(fixes.argv())
        hidden = [line for line in found if not any(names(line, n) for n in fixes.fixed)]
        assert not hidden, (f"{name}: found only after the first run's problems were fixed (reported in stages):\n"
                            + "\n".join(hidden) + "\n\nfirst run:\n" + "\n".join(first))
    assert trainer is not None, f"{name}: still failing after fixing {sorted(fixes.fixed)}:\n" + "\n".join(found)
    changed = changed_values(trainer.cfg, fixes.kept())
    assert not changed, f"{name}: keys accepted with another value:\n" + "\n".join(changed)
    for check in MEANING.get(name, []):
        check(trainer)


def test_a_problem_with_a_key_of_ones_verl_config_names_the_file(tmp_path, monkeypatch):
    """A key refused at validation names the verl config that set it ("set in"), and a command-line key whose value
    the config also sets says so ("also set in"): deleting it from the command line alone would not end the problem."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "conf").mkdir()
    own = tmp_path / "conf" / "mine.yaml"
    own.write_text("defaults:\n  - ppo_trainer\n  - _self_\ndata:\n  truncation: middle\n"
                   "actor_rollout_ref:\n  rollout:\n    name: sglang\n")
    found, trainer = preflight(["--config-path=conf", "--config-name=mine", "actor_rollout_ref.rollout.name=sglang"])
    assert trainer is None
    truncation = [line for line in found if "data.truncation" in line]
    name = [line for line in found if "rollout.name" in line]
    assert len(truncation) == 1 and truncation[0].endswith(" (set in conf/mine.yaml)"), found
    assert len(name) == 1 and name[0].endswith(" (also set in conf/mine.yaml)"), found
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["conf", "mine.yaml"]  # pre-flight wrote nothing
