"""The main job: ``python -m verl_lite.trainer.main_ppo key=value ...`` (Hydra overrides of the schema).

Loads and validates the config BEFORE any Ray process or worker starts, trains with a live progress display,
and writes a fresh run directory ``<trainer.output_dir>/<experiment_name>-<UTC time>`` (``latest`` points at the
newest): ``metrics.jsonl`` (one JSON object per step; step 0 is the validation before training), ``curves.png``
(training reward and held-out accuracy), ``summary.json`` (initial vs final held-out accuracy; ``status``:
completed | failed | interrupted; ``startup_s``), ``config.json`` and ``run.log`` (a failure's full traceback).

``--recipe FILE.yaml`` (repeatable) applies a YAML file of overrides (nested keys, as in docs/config.md) before
the command-line ones; a shipped recipe can be named from any directory: ``--recipe gspo``. verl's
``--config-path`` / ``--config-name ppo_megatron_trainer`` head is passed over (it names the one config there
is); a config of one's own (``--config-name my_grpo``) is read as the first recipe.

Failures end as one readable block on stderr (what failed, the key or file/row, the fix), exit code 2 for bad
input and 1 for runtime failures; ``--debug`` or ``VERL_LITE_DEBUG=1`` also prints the traceback and the
libraries' warnings and logging. SIGINT / SIGTERM stop the run within seconds (the current metrics line is
finished, every worker and the local Ray are stopped), exit 130 / 143.

Also works under ``ray job submit --address ... -- python -m verl_lite.trainer.main_ppo ...``
(Ray is joined through ``RAY_ADDRESS``).
"""

from __future__ import annotations

if __name__ == "__main__":  # the CLI: a signal before the run's own handler ends it with one line, exit 128 + signal
    from verl_lite.trainer.stop_signals import exit_on_early_signals

    exit_on_early_signals()

import contextlib
import os
import sys
import threading
import traceback
from pathlib import Path

from verl_lite.errors import ConfigError, RunInterrupted, describe
from verl_lite.trainer.stop_signals import SIGNALS
from verl_lite.utils.quiet import quiet_process

DEBUG_ENV = "VERL_LITE_DEBUG"


class RunState:
    """What a run has got to: filled by :func:`run`, read by :func:`main` to report a failure."""

    trainer = None

    @property
    def run_dir(self) -> Path | None:
        return getattr(self.trainer, "run_dir", None)


def run(overrides: list[str], state: RunState | None = None) -> dict:
    """Train with the given overrides; returns the summary dict (raises on any error)."""
    from verl_lite.config.loader import Problems, load_config  # inside: an incompatible library is reported like any error
    from verl_lite.trainer.ppo_trainer import PPOTrainer
    from verl_lite.trainer.training_run import train_in_run_dir

    state = state if state is not None else RunState()
    problems = Problems()
    cfg = load_config(overrides, problems)  # the config of the overrides that fit; their problems kept
    trainer = state.trainer = PPOTrainer(cfg, problems=problems)  # pre-flight: every problem at once
    try:
        return train_in_run_dir(trainer)
    finally:
        trainer.reward_manager.close()


RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"  # the repository's recipes/


def resolve_recipe(name_or_path: str) -> Path:
    """``--recipe`` argument -> a YAML file: an existing path; else a shipped recipe by name (``ppo``); else the
    path from the repository root (``recipes/ppo.yaml``). ConfigError lists the shipped recipes when none matches."""
    given = Path(name_or_path).expanduser()
    candidates = [given]
    if not given.is_absolute():
        stem = given.name if given.suffix in (".yaml", ".yml") else f"{given.name}.yaml"
        candidates += [RECIPES_DIR / stem, RECIPES_DIR.parent / given] if len(given.parts) <= 2 else [
            RECIPES_DIR.parent / given]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    shipped = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    raise ConfigError([f"--recipe {name_or_path}: no such file, and no shipped recipe of that name; give a YAML "
                       f"path or one of {shipped}"])


def verl_config_file(config_path: str | None, config_name: str) -> Path | None:
    """verl's Hydra head ``--config-path P --config-name N``: None where N is verl's trainer config (the one config
    verl_lite has, in verl's vocabulary); else the user's YAML ``P/N.yaml`` (P relative to the working directory),
    which ``load_config`` applies first, as Hydra composes it under the command line's overrides."""
    from verl_lite.config.loader import VERL_TRAINER_CONFIGS  # inside: as run()'s, a library failure is reported

    name = config_name.strip("'\"")
    if Path(name).stem in VERL_TRAINER_CONFIGS:
        return None
    file = Path(config_path.strip("'\"") if config_path else ".") / name
    return file if file.suffix in (".yaml", ".yml") else file.with_name(file.name + ".yaml")


FLAG_VALUES = {"--recipe": "a file path", "--config-path": "a value", "--config-name": "a value"}  # flags with a value


def _flag_at(argv: list[str], i: int) -> tuple[str, str, int] | None:
    """``(flag, value, index after it)`` when ``argv[i]`` is ``FLAG VALUE`` or ``FLAG=VALUE`` of ``FLAG_VALUES``."""
    a = argv[i]
    for flag, what in FLAG_VALUES.items():
        if a.startswith(f"{flag}="):
            return flag, a.split("=", 1)[1], i + 1
        if a == flag:
            if i + 1 >= len(argv):
                raise ConfigError([f"{flag} needs {what}"])
            return flag, argv[i + 1], i + 2
    return None


def expand_recipes(argv: list[str]) -> list[str]:
    """``--recipe FILE`` / ``--recipe=FILE`` arguments -> ``--recipe=<resolved path>`` items, which ``load_config``
    applies where it stands: later items override it. verl's ``--config-path`` / ``--config-name`` head: a config of
    the user's own goes first (``verl_config_file``), verl's trainer config is passed over."""
    out, i, config_path, config_name = [], 0, None, None
    while i < len(argv):
        found = _flag_at(argv, i)
        if found is None:
            out.append(argv[i])
            i += 1
            continue
        flag, value, i = found
        if flag == "--recipe":
            out.append(f"--recipe={resolve_recipe(value)}")
        elif flag == "--config-path":
            config_path = value
        else:
            config_name = value
    own = verl_config_file(config_path, config_name) if config_name else None
    return [f"--recipe={own}"] * (own is not None) + out


def _report(err: BaseException, state: RunState, debug: bool) -> int:
    """Print the one readable block (and the traceback when debugging); log the traceback in the run dir."""
    code, block = describe(err)
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    log_note = ""
    if state.run_dir is not None:
        with contextlib.suppress(OSError):
            with open(state.run_dir / "run.log", "a") as f:
                f.write(f"{block}\n\n{tb}")
            log_note = f"; log: {state.run_dir / 'run.log'}"
    if debug:
        print(tb, file=sys.stderr)
    elif not isinstance(err, RunInterrupted):
        block += f"\n  (full traceback: --debug or {DEBUG_ENV}=1{log_note})"
    print(block, file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """The CLI: exit 0 on success, 2 on bad input, 1 on a runtime failure, 130/143 on SIGINT/SIGTERM."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    quiet_process(debug)  # library warnings / notices: hidden unless debugging (driver and workers)
    state = RunState()
    in_main_thread = threading.current_thread() is threading.main_thread()
    try:
        if in_main_thread:
            SIGNALS.received = None
            SIGNALS.install()
        summary = run(expand_recipes(argv), state)
    except BaseException as err:  # noqa: BLE001 - every failure becomes one block and an exit code
        err = SIGNALS.interruption(err)  # also a library's signal handler's SystemExit (stop_signals)
        if isinstance(err, SystemExit):
            raise
        return _report(err, state, debug)
    finally:
        # the reward process, also when the trainer was never fully built; a run that failed before it loaded the
        # reward's module started none (and importing it here could fail the way the run did)
        sandbox = sys.modules.get("verl_lite.reward.sandbox")
        if sandbox is not None:
            sandbox.close_all()
        if in_main_thread:
            SIGNALS.restore()
    from verl_lite.trainer.training_run import accuracy_line  # loaded by run(): not at the CLI's start

    print(f"\nsummary: {summary['steps']} steps; {accuracy_line(summary)}; start-up {summary['startup_s']} s")
    print(f"metrics: {summary['metrics']}\ncurve:   {summary['curve']}")
    return 0


if __name__ == "__main__":
    from verl_lite.compat.fast_exit import exit_now

    exit_now(main)  # the run closed what it opened: skip the interpreter's teardown (compat/fast_exit.py)
