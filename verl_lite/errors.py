"""User-facing failures: one readable block, an exit code, and the fix.

Every failure that reaches the command line ends as :func:`describe`'s block::

    verl_lite: <what failed, naming the key or the file/row>; <the fix>
      (full traceback: --debug or VERL_LITE_DEBUG=1; log: <run dir>/run.log)

Exit codes: ``2`` bad input (a config key, a data file, the output directory), ``1`` a runtime
failure (reward, worker, Ray start-up, disk), ``130`` / ``143`` stopped by SIGINT / SIGTERM.
"""

from __future__ import annotations

import signal

EXIT_RUNTIME = 1
EXIT_BAD_INPUT = 2
EXIT_SIGINT = 128 + signal.SIGINT


class UserError(Exception):
    """A failure the user can act on: ``what`` failed, ``fix`` says what to change."""

    exit_code = EXIT_RUNTIME

    def __init__(self, what: str, fix: str | None = None):
        self.what, self.fix = what, fix
        super().__init__(what if fix is None else f"{what}; {fix}")


class BadInput(UserError):
    """Bad input found before anything started (exit 2)."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(ValueError):
    """A bad config. `problems` lists every problem found, each naming the key and the fix."""

    exit_code = EXIT_BAD_INPUT  # describe()

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid config ({len(self.problems)} problem(s)):\n{lines}")


class Problems:
    """Pre-flight's collector, so one run reports every problem. ``check(fn, ...)`` runs one stage: its result,
    or None when it failed on bad input (exit 2; another failure after earlier problems is put down to them).
    ``raise_if_any()`` raises the one error as it was, or one ConfigError listing every line."""

    def __init__(self, lines=()):
        self.lines, self.errors, self.aliases = list(lines), [], {}
        self.origins = {}  # key -> ('set in' | 'also set in', the recipe / verl config file that set it)

    def check(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - sorted below
            if getattr(e, "exit_code", None) != EXIT_BAD_INPUT and not self.lines:
                raise
            if getattr(e, "exit_code", None) == EXIT_BAD_INPUT:
                self.errors.append(e)
                lines = getattr(e, "problems", None) or [f"{getattr(e, 'describe_prefix', '')}{e}"]
                self.lines += [line for line in lines if line not in self.lines]
            return None

    def mentions(self, *keys: str) -> bool:
        """Whether a problem found so far names one of ``keys`` (a later stage reading them is skipped)."""
        return any(key in line for line in self.lines for key in keys)

    def passes(self, fn, *args, **kwargs) -> bool:
        """:meth:`check` for a stage that returns nothing: whether it found no problem."""
        before = len(self.lines)
        self.check(fn, *args, **kwargs)
        return len(self.lines) == before

    def _origin(self, line: str) -> str:
        """Where the keys a line names were set, when a recipe / verl config file set them."""
        return "".join(f" ({how} {file})" for key, (how, file) in self.origins.items()
                       if key in line and file not in line)

    def raise_if_any(self):
        alone = len(self.errors) == 1 and len(self.lines) == len(getattr(self.errors[0], "problems", None) or [0])
        if alone and not any(map(self._origin, self.lines)):
            # one stage's error alone: raised as it was (its own class and wording)
            raise self.errors[0]
        if self.lines:
            raise ConfigError([line + "".join(f" (set as verl's '{verl}')" for key, verl in self.aliases.items()
                                              if key in line and verl not in line) + self._origin(line)
                               for line in self.lines])


class RunFailure(UserError):
    """The run started and then failed (exit 1)."""


class RayStartError(RunFailure):
    """Ray did not start (or could not be joined) within the bounded retries."""


class NonFiniteTraining(RunFailure):
    """A role's loss or gradient norm went NaN / inf: the run stops at that step, as megatron's NaN
    check does; nothing of the step is logged, checkpointed or exported."""


class RunInterrupted(BaseException):
    """SIGINT / SIGTERM arrived: unwinds the run like KeyboardInterrupt (``except Exception`` does not catch it)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def describe(err: BaseException) -> tuple[int, str]:
    """(exit code, the readable block without the traceback hint) for any exception; an error class states its
    ``exit_code`` (and a ``describe_prefix``); a worker's traceback (``--- worker rank``) goes to the log."""
    if isinstance(err, RunInterrupted):
        return err.exit_code, f"verl_lite: {err}"
    code = getattr(err, "exit_code", None)
    if isinstance(code, int):
        head = str(err).split("\n--- worker rank", 1)[0]
        return code, f"verl_lite: {getattr(err, 'describe_prefix', '')}{head}"
    if isinstance(err, KeyboardInterrupt):
        return EXIT_SIGINT, "verl_lite: stopped by SIGINT"
    return EXIT_RUNTIME, (
        f"verl_lite: internal error: {type(err).__name__}: {err}\n"
        f"  fix: this is a bug in verl_lite or an unchecked input; rerun with VERL_LITE_DEBUG=1 and report the traceback"
    )
