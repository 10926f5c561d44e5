"""Driver-side checkpoints: where they live, atomic writes, retention, resume, and the driver state.

Layout (``trainer.default_local_dir``, verl's name; relative paths resolve against the driver's
working directory, so give an absolute one under ``ray job submit``)::

    <default_local_dir>/
        latest_checkpointed_iteration.txt    the newest complete step (verl's file; informative)
        global_step_K/
            actor/dist/                      megatron dist_checkpointing shards (model, optimizer, LR schedule)
            actor/rng/rank_R.safetensors     each worker's torch RNG state(s)
            actor/hf_config/                 config.json + tokenizer (what an offline export needs)
            critic/...                       the same for the critic, when the run has one
            huggingface/                     the policy: model.safetensors + config + tokenizer
            driver_state.json                step, data position, KL controller, python RNG, ...
            driver_rng.safetensors           the driver's torch (and numpy) RNG states
            complete                         written last (JSON: step, time)

Atomicity: a checkpoint is written into ``.tmp-global_step_K-<id>/``, every file is fsynced, the
``complete`` marker is written and fsynced, then the directory is renamed to ``global_step_K``
(rename is atomic on POSIX file systems). A killed save leaves only a ``.tmp-*`` directory, which
resume ignores (and says so); a ``global_step_*`` directory without ``complete`` is skipped with a
message and the previous complete checkpoint is used.

What the run draws random numbers from, and how each is restored:

- rollout sampling: seeds derived from ``trainer.seed`` and the step (``PPOTrainer.generate_and_score``),
  validation seeds from ``trainer.seed``; mini-batch shuffling from ``trainer.seed`` and the step:
  all restored by restoring ``global_step``;
- data order: ``data.seed`` and the epoch (``verl_lite.data.iterate_batches``): restored by the data
  position (epoch, batches consumed in it), which also covers DAPO's extra generation batches;
- anything that uses the driver's global RNGs (e.g. a reward function calling ``random``): python
  ``random``, torch and numpy global states are saved and restored;
- each worker's torch RNG (dropout, if a model had any): saved per rank, restored when the layout is
  the same (a per-rank stream means nothing in another layout).

Never unpickled: the driver state is JSON + safetensors; the engine side is described in
``verl_lite.engine.checkpoint``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch

from verl_lite.errors import BadInput

PREFIX = "global_step_"
COMPLETE = "complete"
LATEST_FILE = "latest_checkpointed_iteration.txt"
DRIVER_STATE = "driver_state.json"
DRIVER_RNG = "driver_rng.safetensors"
HF_DIR = "huggingface"
STATE_VERSION = 1


def _say(message: str) -> None:
    print(f"verl_lite checkpoint: {message}", file=sys.stderr, flush=True)


# ============================================================================ config
def checkpoint_root(tr) -> Path:
    """``trainer.default_local_dir`` as an absolute path (None = ``checkpoints/<project>/<experiment>``)."""
    raw = tr.default_local_dir or os.path.join("checkpoints", tr.project_name, tr.experiment_name)
    return Path(raw).expanduser().resolve()


# ============================================================================ directory scanning
def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith(PREFIX):
        return None
    tail = name[len(PREFIX):]
    return int(tail) if tail.isdigit() else None


def list_checkpoints(root: Path, quiet: bool = False) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first. Incomplete ones are reported (unless quiet) and skipped."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if child.name.startswith(".tmp-" + PREFIX):
            if not quiet:
                _say(f"skipping {child} (a save that did not finish)")
            continue
        step = step_of(child)
        if step is None or not child.is_dir():
            continue
        if not is_complete(child):
            if not quiet:
                _say(f"skipping {child}: no '{COMPLETE}' marker (the save did not finish)")
            continue
        found.append((step, child))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


# ============================================================================ driver state
@dataclass
class DriverState:
    global_step: int
    data_epoch: int  # the epoch the next prompt batch comes from
    data_batch: int  # batches of that epoch already consumed
    kl_coef: float | None  # the in-reward KL controller's current value
    python_random: list  # random.getstate(), as JSON lists
    config_digest: dict  # a few keys that must not change on resume (checked)
    version: int = STATE_VERSION


def _python_state_to_json(state) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_state_from_json(data) -> tuple:
    version, internal, gauss = data
    return (version, tuple(internal), gauss)


def _global_rng_tensors() -> dict[str, torch.Tensor]:
    out = {"torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy_keys"] = torch.from_numpy(keys.astype("int64"))
        out["numpy_meta"] = torch.tensor([pos, has_gauss], dtype=torch.int64)
        out["numpy_cached"] = torch.tensor([cached], dtype=torch.float64)
    except ImportError:  # pragma: no cover
        pass
    return out


def _restore_global_rng(t: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(t["torch"])
    if "numpy_keys" in t:
        import numpy as np

        pos, has_gauss = (int(x) for x in t["numpy_meta"].tolist())
        np.random.set_state(("MT19937", t["numpy_keys"].numpy().astype("uint32"), pos, has_gauss,
                             float(t["numpy_cached"][0])))


def _config_digest(cfg) -> dict:
    d = cfg.data
    return {"data.train_batch_size": d.train_batch_size, "data.seed": d.seed, "data.shuffle": d.shuffle,
            "trainer.seed": cfg.trainer.seed}


# ============================================================================ data position
class DataCursor:
    """Prompt batches in ``(data.seed, epoch)`` order, forever, resumable at (epoch, batch)."""

    def __init__(self, dataset, batch_size: int, shuffle: bool, seed: int, epoch: int = 0, batch: int = 0):
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.epoch, self.batch = epoch, batch
        self._it: Iterator | None = None

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        from verl_lite.data import iterate_batches, num_batches

        while True:
            if self._it is None:
                self._it = iterate_batches(self.dataset, self.batch_size, self.shuffle, self.seed, self.epoch)
                for _ in range(self.batch):  # resume inside the epoch
                    next(self._it)
            if self.batch < num_batches(self.dataset, self.batch_size):
                rows = next(self._it)
                self.batch += 1
                return rows
            self.epoch, self.batch, self._it = self.epoch + 1, 0, None


# ============================================================================ file helpers
def _fsync_tree(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:  # pragma: no cover
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse directory fsync
        pass
    finally:
        os.close(fd)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# ============================================================================ the manager
class CheckpointManager:
    """What ``PPOTrainer.fit`` calls: ``cursor = mgr.resume(trainer)`` after the workers started,
    ``mgr.after_step(trainer, cursor, last)`` after every step (saves per ``save_freq`` and at the end)."""

    def __init__(self, cfg):
        tr = cfg.trainer
        self.cfg = cfg
        self.root = checkpoint_root(tr)
        self.save_freq = tr.save_freq
        self.keep = tr.max_actor_ckpt_to_keep
        self.resume_mode = tr.resume_mode
        self.resume_from = Path(tr.resume_from_path).expanduser().resolve() if tr.resume_from_path else None
        self.resumed_from: Path | None = None
        self.last_saved_step: int | None = None

    # ---------------------------------------------------------------- resume
    def resume_path(self) -> Path | None:
        if self.resume_mode == "disable":
            return None
        if self.resume_mode == "resume_path":
            if not is_complete(self.resume_from):
                raise BadInput(f"trainer.resume_from_path={str(self.resume_from)!r} is not a complete checkpoint (no "
                               f"'{COMPLETE}' marker in it)", "give a global_step_K directory written by verl_lite")
            return self.resume_from
        path = latest_checkpoint(self.root)
        if path is None:
            _say(f"no complete checkpoint under {self.root}: starting from step 0")
        return path

    def resume(self, trainer) -> DataCursor:
        """Load the checkpoint ``resume_mode`` selects (if any) into the trainer; return the data cursor."""
        d = self.cfg.data
        cursor = DataCursor(trainer.train_dataset, d.train_batch_size, d.shuffle, d.seed)
        path = self.resume_path()
        if path is None:
            return cursor
        from safetensors.torch import load_file

        state = json.loads((path / DRIVER_STATE).read_text())
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"{path}: driver state version {state.get('version')} != {STATE_VERSION}")
        digest = _config_digest(self.cfg)
        changed = {k: (v, digest.get(k)) for k, v in state["config_digest"].items() if digest.get(k) != v}
        if changed:
            raise ValueError(f"{path}: cannot resume with changed " + ", ".join(
                f"{k} (saved {a!r}, now {b!r})" for k, (a, b) in changed.items()))
        t0 = time.perf_counter()
        infos = {"actor": trainer.actor.call_all("load_checkpoint", str(path / "actor"))}
        if getattr(trainer, "critic", None) is not None:
            if not (path / "critic").is_dir():
                raise ValueError(f"{path} holds no critic state but this run trains a critic")
            infos["critic"] = trainer.critic.call_all("load_checkpoint", str(path / "critic"))
        trainer.global_step = int(state["global_step"])
        if trainer.kl_ctrl is not None and state["kl_coef"] is not None:
            trainer.kl_ctrl.value = float(state["kl_coef"])
        random.setstate(_python_state_from_json(state["python_random"]))
        _restore_global_rng(load_file(str(path / DRIVER_RNG)))
        cursor.epoch, cursor.batch = int(state["data_epoch"]), int(state["data_batch"])
        self.resumed_from = path
        self.last_saved_step = trainer.global_step
        layout = infos["actor"][0]["layout"]
        rng = all(i["rng_restored"] for role in infos.values() for i in role)
        _say(f"resumed from {path} (step {trainer.global_step}, saved at layout {layout}; worker RNG "
             f"{'restored' if rng else 'not restored: the layout differs'}) in {time.perf_counter() - t0:.1f}s")
        return cursor

    # ---------------------------------------------------------------- save
    def after_step(self, trainer, cursor: DataCursor, last: bool) -> dict:
        """With ``save_freq > 0``: save every ``save_freq`` steps and at the last step (each checkpoint
        holds the HF export). Returns ``{"timing_s/save_checkpoint": s}`` when it saved."""
        step = trainer.global_step
        if self.save_freq > 0 and (step % self.save_freq == 0 or last) and self.last_saved_step != step:
            t0 = time.perf_counter()
            self.save(trainer, cursor)
            return {"timing_s/save_checkpoint": time.perf_counter() - t0}
        return {}

    def save(self, trainer, cursor: DataCursor) -> Path:
        """Write ``global_step_<step>`` atomically (see the module docstring); apply retention."""
        from safetensors.torch import save_file

        step = trainer.global_step
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"{PREFIX}{step}"
        tmp = self.root / f".tmp-{PREFIX}{step}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        trainer.actor.call_all("save_checkpoint", str(tmp / "actor"), str(tmp / HF_DIR))
        if getattr(trainer, "critic", None) is not None:
            trainer.critic.call_all("save_checkpoint", str(tmp / "critic"))
        state = DriverState(
            global_step=step, data_epoch=cursor.epoch, data_batch=cursor.batch,
            kl_coef=None if trainer.kl_ctrl is None else float(trainer.kl_ctrl.value),
            python_random=_python_state_to_json(random.getstate()), config_digest=_config_digest(self.cfg),
        )
        (tmp / DRIVER_STATE).write_text(json.dumps(asdict(state)))
        save_file(_global_rng_tensors(), str(tmp / DRIVER_RNG))
        _fsync_tree(tmp)
        _write_atomic(tmp / COMPLETE, json.dumps({"global_step": step, "time": time.time()}))
        if final.exists():  # the same step saved again (e.g. a resumed run that trained no further)
            old = self.root / f".old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        _write_atomic(self.root / LATEST_FILE, str(step))
        self.last_saved_step = step
        self._retain()
        return final

    def _retain(self) -> None:
        if self.keep is None:
            return
        found = list_checkpoints(self.root, quiet=True)
        for _step, path in found[:-self.keep]:
            if path == self.resumed_from and len(found) <= self.keep:  # pragma: no cover
                continue
            doomed = self.root / f".old-{path.name}-{uuid.uuid4().hex[:8]}"
            os.replace(path, doomed)  # atomic: never a half-deleted checkpoint that looks complete
            shutil.rmtree(doomed, ignore_errors=True)

    def export_final(self, trainer) -> Path:
        """The current policy as ``<root>/huggingface`` (replaced atomically), without a checkpoint."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".tmp-{HF_DIR}-{uuid.uuid4().hex[:8]}"
        trainer.actor.call_all("export_hf_dir", str(tmp))
        _fsync_tree(tmp)
        final = self.root / HF_DIR
        if final.exists():
            old = self.root / f".old-{HF_DIR}-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(self.root)
        return final
