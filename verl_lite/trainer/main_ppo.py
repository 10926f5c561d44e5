"""The main job: ``python -m verl_lite.trainer.main_ppo key=value ...`` (Hydra overrides of ppo_trainer.yaml).

Loads and validates the config BEFORE any Ray process or worker starts, trains with a live
progress display, and writes into ``trainer.output_dir``:

- ``metrics.jsonl``: one JSON object per step (rewards, losses, KL, entropy, grad norm,
  validation accuracy, timing per stage); step 0 is the validation before training;
- ``curves.png``: training reward and held-out accuracy against the step;
- ``summary.json``: initial vs final held-out accuracy.

Each run writes into a fresh directory ``<trainer.output_dir>/<experiment_name>-<UTC time>``
(``<trainer.output_dir>/latest`` points at the newest), so no run overwrites another's results;
it is created and checked writable before Ray starts. It also holds ``config.json``,
``summary.json`` (``status``: completed | failed | interrupted; ``startup_s``) and ``run.log``
(the full traceback of a failure).

``--recipe FILE.yaml`` (repeatable) applies a YAML file of overrides (nested keys, as in
ppo_trainer.yaml) before the command-line ones, e.g. ``--recipe recipes/gspo.yaml``; a shipped
recipe can be named from any directory: ``--recipe gspo``.

Failures end as one readable block on stderr (what failed, the key or file/row, the fix) with
exit code 2 for bad input (config, data, output dir) and 1 for runtime failures; ``--debug`` or
``VERL_LITE_DEBUG=1`` also prints the traceback. SIGINT / SIGTERM stop the run within a few
seconds (the current metrics line is finished, every worker and the local Ray are stopped) and
exit 130 / 143.

Also works under ``ray job submit --address ... -- python -m verl_lite.trainer.main_ppo ...``
(Ray is joined through ``RAY_ADDRESS``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

from verl_lite.config import ConfigError, config_to_dict, load_config
from verl_lite.errors import RunFailure, RunInterrupted, describe

DEBUG_ENV = "VERL_LITE_DEBUG"
STOP_GRACE_S = 10.0  # after SIGINT/SIGTERM the run is force-stopped if its teardown takes longer


class RunState:
    """What a run has got to: filled by :func:`run`, read by :func:`main` to report a failure."""

    def __init__(self):
        self.run_dir: Path | None = None
        self.trainer = None


class _Signals:
    """SIGINT/SIGTERM -> :class:`RunInterrupted` in the main thread (deferred while a metrics line is
    written), plus a watchdog that SIGKILLs the run's processes and exits if teardown overruns."""

    def __init__(self):
        self.received: int | None = None
        self._deferring = 0
        self._pending: int | None = None
        self._previous: dict = {}

    def install(self) -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            return  # a repeated signal: the first one is being handled, the watchdog bounds it
        self.received = signum
        threading.Thread(target=self._watchdog, args=(signum,), name="verl_lite-stop-watchdog", daemon=True).start()
        if self._deferring:
            self._pending = signum
            return
        raise RunInterrupted(signum)

    @staticmethod
    def _watchdog(signum: int) -> None:
        time.sleep(STOP_GRACE_S)
        import psutil

        from verl_lite.utils.processes import kill_and_wait

        procs = psutil.Process().children(recursive=True)
        kill_and_wait(procs, timeout_s=3.0)
        print(f"verl_lite: stopped by {signal.Signals(signum).name}; teardown overran {STOP_GRACE_S:.0f}s, "
              f"{len(procs)} process(es) of the run were killed", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    @contextmanager
    def deferred(self):
        """A signal arriving inside the block is raised when the block ends (never mid-line)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            if not self._deferring and self._pending is not None:
                signum, self._pending = self._pending, None
                raise RunInterrupted(signum)


_SIGNALS = _Signals()


def _warn(message: str) -> None:
    print(f"verl_lite: warning: {message}", file=sys.stderr, flush=True)


def _seconds_since_process_start() -> float:
    """Wall seconds since this process started, to ~10 ms: on Linux from /proc (the start tick vs the
    uptime clock); psutil's ``create_time`` adds the boot time, which /proc/stat rounds to a whole second."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        import psutil

        return time.time() - psutil.Process().create_time()


def run(overrides: list[str], state: RunState | None = None) -> dict:
    """Train with the given overrides; returns the summary dict (raises on any error)."""
    from verl_lite.config.preflight import check_model_files
    from verl_lite.trainer.ppo_trainer import PPOTrainer
    from verl_lite.trainer.run_dir import make_run_dir

    state = state if state is not None else RunState()
    cfg = load_config(overrides)
    check_model_files(cfg)  # a broken config.json before the tokenizer reads it
    trainer = PPOTrainer(cfg)  # validates the config, the data and the reward function; nothing is started yet
    state.trainer = trainer
    try:
        out = make_run_dir(cfg.trainer.output_dir, cfg.trainer.experiment_name)
        state.run_dir = trainer.run_dir = out  # as fit() does: the trainer writes its files there too
        return _train(cfg, trainer, out)
    finally:
        trainer.reward_manager.close()


def train_in_run_dir(trainer, on_step=None) -> dict:
    """What the CLI does after the config is loaded, for a built ``PPOTrainer`` (the Python API's
    ``fit()``): a fresh run directory, trackers, curves, summary. Returns the summary."""
    from verl_lite.trainer.run_dir import make_run_dir

    out = make_run_dir(trainer.cfg.trainer.output_dir, trainer.cfg.trainer.experiment_name)
    trainer.run_dir = out
    return _train(trainer.cfg, trainer, out, user_on_step=on_step)


def _train(cfg, trainer, out: Path, user_on_step=None) -> dict:
    from verl_lite.trainer.metrics import plot_curves
    from verl_lite.trainer.signal_watch import ZeroSignalWatch

    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=1, default=str))
    from verl_lite.trainer.tracking import Tracking

    # trainer.logger backends; metrics.jsonl always (the summary points at it)
    tracking = Tracking(cfg, out, trainer.total_steps(), config_dict=config_to_dict(cfg), always_jsonl=True)
    records: list[dict] = []
    watch = ZeroSignalWatch()

    def on_step(record: dict) -> None:
        records.append(record)
        if user_on_step is not None:
            user_on_step(record)
        with _SIGNALS.deferred():
            try:
                tracking.log(record)
            except OSError as e:
                raise RunFailure(f"writing {tracking.metrics_path} failed at step {record.get('step')} ({e.strerror or e})",
                                 "free disk space or set trainer.output_dir to a disk with room") from None
        warning = watch.update(record)
        if warning:
            _warn(warning)

    summary = {"status": "failed", "steps": 0, "startup_s": None}
    try:
        trainer.start()  # Ray + workers + engines (fit() finds them started)
        summary["startup_s"] = round(_seconds_since_process_start(), 2)
        trainer.run_loop(on_step=on_step)
        summary["status"] = "completed"
    except RunInterrupted as e:
        summary["status"] = f"interrupted ({signal.Signals(e.signum).name})"
        raise
    finally:
        trainer.close()
        try:
            tracking.close()
        except OSError:
            pass
        if records:
            try:
                plot_curves(records, out / "curves.png")
            except Exception as e:  # a plot never hides the run's own result or error
                _warn(f"could not draw {out / 'curves.png'}: {type(e).__name__}: {e}")
        vals = [(r["step"], r["val/accuracy"]) for r in records if r.get("val/accuracy") is not None]
        summary.update({
            "steps": trainer.global_step,
            "initial_val_accuracy": vals[0][1] if vals else None,
            "initial_val_step": vals[0][0] if vals else None,
            "final_val_accuracy": vals[-1][1] if vals else None,
            "final_val_step": vals[-1][0] if vals else None,
            "total_time_s": sum(r.get("timing_s/step", 0.0) + r.get("timing_s/validate", 0.0) for r in records),
            "run_dir": str(out),
            "metrics": str(out / "metrics.jsonl"),
            "curve": str(out / "curves.png"),
        })
        try:
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
        except OSError as e:
            if summary["status"] == "completed":
                raise RunFailure(f"writing {out / 'summary.json'} failed ({e.strerror or e})",
                                 "free disk space or set trainer.output_dir to a disk with room") from None
    return summary


RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"  # the repository's recipes/


def resolve_recipe(name_or_path: str) -> Path:
    """``--recipe`` argument -> a YAML file, from any working directory: an existing path; else a
    shipped recipe by name (``ppo`` -> recipes/ppo.yaml); else the path taken from the repository
    root (``recipes/ppo.yaml``). ConfigError lists the shipped recipes when none matches."""
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


def recipe_overrides(path: str) -> list[str]:
    """A YAML file of nested keys (or a shipped recipe's name, see ``resolve_recipe``) -> Hydra ``key=value``
    overrides."""
    from omegaconf import OmegaConf

    path = str(resolve_recipe(path))
    flat: list[str] = []

    def walk(node, prefix):
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and value and name != "reward.custom_reward_function.reward_kwargs":
                walk(value, name + ".")
            else:
                text = "null" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)
                flat.append(f"{name}={text}")

    walk(OmegaConf.to_container(OmegaConf.load(path)), "")
    return flat


def expand_recipes(argv: list[str]) -> list[str]:
    """``--recipe FILE`` / ``--recipe=FILE`` arguments -> their overrides, in place."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--recipe":
            if i + 1 >= len(argv):
                raise ConfigError(["--recipe needs a file path"])
            out += recipe_overrides(argv[i + 1])
            i += 2
            continue
        if a.startswith("--recipe="):
            out += recipe_overrides(a.split("=", 1)[1])
        else:
            out.append(a)
        i += 1
    return out


def _report(err: BaseException, state: RunState, debug: bool) -> int:
    """Print the one readable block (and the traceback when debugging); log the traceback in the run dir."""
    code, block = describe(err)
    tb = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    log_note = ""
    if state.run_dir is not None:
        try:
            with open(state.run_dir / "run.log", "a") as f:
                f.write(f"{block}\n\n{tb}")
            log_note = f"; log: {state.run_dir / 'run.log'}"
        except OSError:
            pass
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
    state = RunState()
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:
        _SIGNALS.received = None
        _SIGNALS.install()
    try:
        summary = run(expand_recipes(argv), state)
    except BaseException as err:  # noqa: BLE001 - every failure becomes one block and an exit code
        if isinstance(err, SystemExit):
            raise
        return _report(err, state, debug)
    finally:
        from verl_lite.reward.sandbox import close_all

        close_all()  # the reward process, also when the trainer was never fully built
        if in_main_thread:
            _SIGNALS.restore()
    a0, a1 = summary["initial_val_accuracy"], summary["final_val_accuracy"]
    if a0 is None:
        accuracy = "no validation ran (trainer.test_freq <= 0 and trainer.val_before_train=false)"
    else:
        accuracy = (f"held-out accuracy {a0:.3f} (step {summary['initial_val_step']}) -> "
                    f"{a1:.3f} (step {summary['final_val_step']}), {100 * (a1 - a0):+.1f} points")
    print(f"\nsummary: {summary['steps']} steps; {accuracy}; start-up {summary['startup_s']} s")
    print(f"metrics: {summary['metrics']}\ncurve:   {summary['curve']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
