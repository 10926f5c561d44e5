"""One run at a time per checkpoint directory (docs/checkpoints.md, "One run per directory"): an exclusive,
non-blocking ``flock`` on ``<trainer.default_local_dir>/.verl_lite.lock``, taken before Ray starts, holding the
holder's pid and host as JSON; a second run stops with :class:`CheckpointDirInUse`. The descriptor is close-on-exec
and closed in forked children. The file stays (deleting it would let two runs lock two files); release empties it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import socket
import time
from pathlib import Path

from verl_lite.errors import BadInput
from verl_lite.utils import safe_files

LOCK_NAME = ".verl_lite.lock"
HOLDER_LIMIT = 4096  # bytes of a holder record read at most
HOLDER_READ_TRIES = 20  # the holder writes its pid just after taking the lock: read it up to this many times


class CheckpointDirInUse(BadInput):
    """Another live run holds the checkpoint directory's lock (refused before anything started)."""


class RunLock:
    """An exclusive flock on ``directory / LOCK_NAME``, held from :meth:`acquire` to :meth:`release`."""

    def __init__(self, directory: Path, key: str = "trainer.default_local_dir"):
        self.directory, self.key = Path(directory), key
        self.path = self.directory / LOCK_NAME
        self._fd: int | None = None
        self._pid: int | None = None  # the process that took it (a forked copy of this object releases nothing)

    @property
    def held(self) -> bool:
        return self._fd is not None and self._pid == os.getpid()

    def acquire(self) -> RunLock:
        """Take the lock and record this process as the holder (:class:`BadInput` if the directory is unusable)."""
        if self.held:
            return self
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._in_use(read_holder(self.path)) from None
        except OSError as e:
            os.close(fd)
            raise BadInput(f"{self.key}={str(self.directory)!r}: cannot lock {self.path} ({e.strerror or e})",
                           f"set {self.key} to a directory on a file system that supports file locks") from None
        self._fd, self._pid = fd, os.getpid()
        _FORKED_CLOSE.add(fd)
        self._write_holder()
        return self

    def release(self) -> None:
        """Empty the holder record and drop the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None or self._pid != os.getpid():
            return
        _FORKED_CLOSE.discard(fd)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the only descriptor of the open file releases the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _open(self) -> int:
        fix = f"set {self.key} to a directory you can write (it is created if missing)"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            why = "it is a symbolic link, which is never followed" if e.errno == errno.ELOOP else e.strerror or e
            raise BadInput(f"{self.key}={str(self.directory)!r}: cannot create the lock file {self.path} ({why})",
                           f"remove {self.path} and retry" if e.errno == errno.ELOOP else fix) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise BadInput(f"{self.key}={str(self.directory)!r}: the lock file {self.path} is not a regular file",
                           f"remove {self.path} and retry")
        return fd

    def _write_holder(self) -> None:
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        data = json.dumps(record).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)
        os.fsync(self._fd)

    def _in_use(self, holder: dict) -> CheckpointDirInUse:
        if holder.get("pid") is None:
            who = "another run (its pid is not recorded yet)"
        else:
            who = f"another run: pid {holder['pid']} on host {holder.get('host', '?')}"
            if holder.get("started"):
                who += f", started {holder['started']}"
        return CheckpointDirInUse(
            f"{self.key}={str(self.directory)!r} is in use by {who} (lock file {self.path}); two runs writing "
            f"one checkpoint directory would overwrite each other's global_step_K",
            f"wait for that run to end, or give this run another {self.key}")


def read_holder(path: Path) -> dict:
    """The holder record of a lock file (``{}`` when empty, unreadable or not written yet)."""
    for attempt in range(HOLDER_READ_TRIES):
        try:
            text = safe_files.read_bounded(Path(path).parent, Path(path).name, HOLDER_LIMIT).decode("utf-8", "replace")
        except (OSError, safe_files.UnsafeFile):
            return {}
        if text.strip():
            try:
                record = json.loads(text)
            except ValueError:
                record = None
            if isinstance(record, dict):
                return record
        time.sleep(0.01)
    return {}


def lock_checkpoint_dir(trainer_cfg) -> RunLock | None:
    """The held lock of ``trainer.default_local_dir`` when the run saves checkpoints (``save_freq > 0``), else None."""
    from verl_lite.trainer.checkpointing import checkpoint_root  # checkpointing imports torch: not at the CLI's start

    if trainer_cfg.save_freq <= 0:
        return None
    return RunLock(checkpoint_root(trainer_cfg)).acquire()


# descriptors of held locks: a child made by a bare fork() closes its copies, so a lock dies with its driver
_FORKED_CLOSE: set[int] = set()


def _close_in_child() -> None:
    for fd in list(_FORKED_CLOSE):
        with contextlib.suppress(OSError):
            os.close(fd)
    _FORKED_CLOSE.clear()


os.register_at_fork(after_in_child=_close_in_child)
