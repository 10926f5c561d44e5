"""Where a run writes: a fresh directory per run, so that no run ever overwrites another's results."""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

from verl_lite.errors import BadInput

LATEST = "latest"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "run"


def make_run_dir(output_dir: str, experiment_name: str, now: float | None = None) -> Path:
    """A fresh, writable ``<output_dir>/<experiment_name>-<UTC yyyymmdd-HHMMSS>[-k]`` (``-k``: runs started in the
    same second; ``mkdir`` without ``exist_ok`` is atomic); ``<output_dir>/latest`` points at it. One that cannot
    be made or written is a :class:`BadInput` naming ``trainer.output_dir``."""
    root = Path(output_dir).expanduser().resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    base = f"{_safe(experiment_name)}-{stamp}"
    fix = "set trainer.output_dir to a directory you can write (it is created if missing)"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"trainer.output_dir={output_dir!r}: cannot create {root} ({e.strerror or e})", fix) from None
    for k in range(1, 1000):
        run = root / (base if k == 1 else f"{base}-{k}")
        try:
            run.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            raise BadInput(f"trainer.output_dir={output_dir!r}: cannot create a run directory in {root} "
                           f"({e.strerror or e})", fix) from None
        break
    else:  # pragma: no cover
        raise BadInput(f"trainer.output_dir={output_dir!r}: 999 runs named {base} already exist", fix)
    probe = run / ".write_check"
    try:
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise BadInput(f"trainer.output_dir={output_dir!r}: {run} is not writable ({e.strerror or e})", fix) from None
    _point_latest(root, run)
    return run


def _point_latest(root: Path, run: Path) -> None:
    """``<root>/latest`` -> the new run (replaced atomically; skipped where symlinks are not possible)."""
    tmp = root / f".{LATEST}.{os.getpid()}"
    try:
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(run.name)
        os.replace(tmp, root / LATEST)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
