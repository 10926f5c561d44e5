"""Driver-side checkpoints: where they live, atomic writes, retention, resume, and the driver state
(docs/checkpoints.md: the layout, atomicity, integrity). A save writes ``.tmp-global_step_K-<id>/``, fsyncs it,
writes the ``complete`` marker (the manifest) last and renames it to ``global_step_K``; before anything reads one,
:func:`verify_checkpoint` refuses a damaged or unsafe one with one :class:`CheckpointRefused` naming the file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from verl_lite.controller.config import STREAMED_MODES
from verl_lite.errors import BadInput
from verl_lite.utils import safe_files

PREFIX = "global_step_"
COMPLETE = "complete"
LATEST_FILE = "latest_checkpointed_iteration.txt"
DRIVER_STATE = "driver_state.json"
DRIVER_RNG = "driver_rng.safetensors"
ASYNC_FILE = "async_pipeline.pt"  # split placement: policy version + in-flight batches (plain data, weights_only load)
HF_DIR = "huggingface"
STATE_VERSION = 1
MANIFEST_KEY = "files"  # in the complete marker: {relative path: {"size": bytes, "sha256": hex}}
HASH_NAME = "sha256"
HASH_THREADS = 8
ROLES = ("actor", "critic")


def _say(message: str) -> None:
    print(f"verl_lite checkpoint: {message}", file=sys.stderr, flush=True)


# ============================================================================ config
def checkpoint_root(tr) -> Path:
    """``trainer.default_local_dir`` as an absolute path (None, in a config not built by the loader:
    ``loader.default_checkpoint_dir``)."""
    from verl_lite.config.loader import default_checkpoint_dir

    return Path(tr.default_local_dir or default_checkpoint_dir(tr)).expanduser().resolve()


# ============================================================================ directory scanning
def is_complete(path: Path) -> bool:
    return (path / COMPLETE).is_file()


def step_of(path: Path) -> int | None:
    tail = path.name.removeprefix(PREFIX)
    return int(tail) if tail != path.name and tail.isdigit() else None


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


# ============================================================================ integrity
class CheckpointRefused(BadInput):
    """A checkpoint is damaged or unsafe to read; the message names the file. Nothing of it was loaded."""


def _hash_file(directory: Path, rel: str) -> str:
    fd = safe_files.open_inside(directory, rel)
    with open(fd, "rb") as f:
        return hashlib.file_digest(f, HASH_NAME).hexdigest()


def _hash_files(directory: Path, rels: list[str]) -> dict[str, str]:
    """sha256 of each ``directory / rel``, several files at once (hashlib releases the GIL)."""
    with ThreadPoolExecutor(max_workers=max(1, min(HASH_THREADS, len(rels)))) as pool:
        return dict(zip(rels, pool.map(lambda rel: _hash_file(directory, rel), rels)))


def build_manifest(directory: Path) -> dict[str, dict]:
    """``{relative path: {"size": bytes, "sha256": hex}}`` of every file of a checkpoint being saved."""
    sizes = {rel: size for rel, size in safe_files.scan_tree(directory).items() if rel != COMPLETE}
    digests = _hash_files(directory, sorted(sizes))
    return {rel: {"size": sizes[rel], HASH_NAME: digests[rel]} for rel in sorted(sizes)}


def _read_json(path: Path, name: str, fix: str | None, what: str = ""):
    """``path/name`` parsed (``safe_files.read_json``'s bounds); :class:`CheckpointRefused` naming it otherwise."""
    try:
        return safe_files.read_json(path, name)
    except safe_files.UnsafeFile as e:
        raise CheckpointRefused(f"{what}{e}", fix) from None


def _manifest(path: Path, fix: str | None) -> dict[str, dict] | None:
    """The marker's manifest (None: written before manifests), each entry checked to be well formed."""
    marker = _read_json(path, COMPLETE, fix, "checkpoint marker ")
    if not isinstance(marker, dict):
        raise CheckpointRefused(f"checkpoint marker {path / COMPLETE} holds no JSON object", fix)
    files = marker.get(MANIFEST_KEY)
    if files is None:
        return None
    ok = isinstance(files, dict) and all(
        isinstance(rel, str) and safe_files.is_plain_relative(rel)
        and isinstance(rec, dict) and type(rec.get("size")) is int and isinstance(rec.get(HASH_NAME), str)
        for rel, rec in files.items())
    if not ok:
        raise CheckpointRefused(f"the manifest in {path / COMPLETE} is malformed (not written by verl_lite)", fix)
    return files


def _damage(path: Path, manifest: dict[str, dict], on_disk: dict[str, int]) -> list[tuple[str, str]]:
    """(file, what is wrong) for each manifest entry that differs on disk: sizes first, then content."""
    problems = []
    for rel, rec in sorted(manifest.items()):
        if rel not in on_disk:
            problems.append((rel, "is missing"))
        elif on_disk[rel] != rec["size"]:
            problems.append((rel, f"is {on_disk[rel]} bytes where the save wrote {rec['size']} (truncated or overwritten)"))
    if problems:
        return problems
    digests = _hash_files(path, sorted(manifest))
    return [(rel, f"does not match the {HASH_NAME} the save recorded (its content changed)")
            for rel in sorted(manifest) if digests[rel] != manifest[rel][HASH_NAME]]


def verify_checkpoint(path: Path, fix: str | None = None, under: str | None = None) -> int:
    """Check checkpoint ``path`` before anything reads it; raise :class:`CheckpointRefused` naming the first
    file that fails, with ``fix`` as the remedy: 1. only regular files and directories (no link, FIFO or
    device); 2. with a manifest: no file outside it, each file's size, then sha256, as the save recorded;
    3. :func:`check_contents`. ``under`` (the role an export reads) limits the hashing to that directory.
    Returns how many files the manifest verified (0: a checkpoint written before manifests, which is said)."""
    path = Path(path)
    try:
        on_disk = safe_files.scan_tree(path)
    except safe_files.UnsafeFile as e:
        raise CheckpointRefused(f"checkpoint {path} is unsafe to read: {e}", fix) from None
    manifest = _manifest(path, fix)
    if manifest is None:
        _say(f"{path} was saved without checksums (an older verl_lite): its files are not verified")
    else:
        strays = sorted(set(on_disk) - set(manifest) - {COMPLETE})
        if strays:
            raise CheckpointRefused(f"checkpoint {path} holds {strays[0]}, which its save did not write (not in the "
                                    f"manifest{f'; and {len(strays) - 1} more' if len(strays) > 1 else ''})", fix)
        if under is not None:
            manifest = {rel: rec for rel, rec in manifest.items() if rel.startswith(under.rstrip("/") + "/")}
        problems = _damage(path, manifest, on_disk)
        if problems:
            (rel, what), more = problems[0], len(problems) - 1
            raise CheckpointRefused(f"checkpoint {path} is damaged: {rel} {what}"
                                    + (f" (and {more} more file{'s' * (more > 1)})" if more else ""), fix)
    check_contents(path, on_disk, fix)
    return 0 if manifest is None else len(manifest)


CONFIG_FILE_LIMIT = 256 * safe_files.MIB  # a file of hf_config/ (config.json, tokenizer files)


def check_contents(path: Path, on_disk: dict[str, int], fix: str | None = None) -> None:
    """Every file a load parses, checked as its reader will trust it: each role's dist-checkpoint index
    through the restricted unpickler, every safetensors header, every JSON file (bounded)."""
    from verl_lite.engine.checkpoint import UnsafeCheckpointFile, check_dist_dir

    try:
        for role in ROLES:
            if (path / role / "dist").is_dir():
                check_dist_dir(path / role / "dist")
        for rel, size in sorted(on_disk.items()):
            model_files = rel.startswith(f"{HF_DIR}/") or "/hf_config/" in rel
            if rel.endswith(".safetensors"):
                safe_files.check_safetensors(path, rel)
            elif rel.endswith(".json"):
                safe_files.read_json(path, rel, CONFIG_FILE_LIMIT if model_files else safe_files.JSON_LIMIT)
            elif model_files and size > CONFIG_FILE_LIMIT:
                raise safe_files.UnsafeFile(f"{path / rel}: {size} bytes, more than a model config or tokenizer "
                                            f"file may hold")
    except (safe_files.UnsafeFile, UnsafeCheckpointFile, ValueError) as e:
        raise CheckpointRefused(str(e), fix) from None


def read_async_state(path: Path, fix: str | None = None) -> dict:
    """``path/ASYNC_FILE`` (the policy version and the rollouts ahead), loaded with ``weights_only=True`` and
    rebuilt into rollout items; :class:`CheckpointRefused` naming the file when it does not hold that."""
    from verl_lite.controller.pipeline import RolloutItem

    file = path / ASYNC_FILE
    try:
        saved = torch.load(io.BytesIO(safe_files.read_bounded(path, ASYNC_FILE, ASYNC_LIMIT)), map_location="cpu",
                           weights_only=True)
        if not isinstance(saved, dict) or type(saved.get("policy_version")) is not int or \
                not isinstance(saved.get("in_flight"), list):
            raise ValueError("not a dict with an int policy_version and a list in_flight")
        return {**saved, "in_flight": [RolloutItem.from_state(item) for item in saved["in_flight"]]}
    except safe_files.UnsafeFile as e:
        raise CheckpointRefused(str(e), fix) from None
    except Exception as e:  # weights_only and the rebuild refuse a crafted file in many ways
        raise CheckpointRefused(f"{file} does not hold split placement's pipeline state "
                                f"({type(e).__name__}: {e})", fix) from None


ASYNC_LIMIT = 16 * safe_files.GIB  # the in-flight batches of split placement


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


def read_driver_state(path: Path, fix: str | None = None) -> DriverState:
    """``path/driver_state.json``, parsed and type-checked; :class:`CheckpointRefused` naming the file otherwise."""
    file, raw = path / DRIVER_STATE, _read_json(path, DRIVER_STATE, fix)
    if not isinstance(raw, dict) or (missing := [f.name for f in fields(DriverState) if f.name not in raw]):
        what = "is not a JSON object" if not isinstance(raw, dict) else f"lacks {missing}"
        raise CheckpointRefused(f"{file} {what}: not a driver state written by verl_lite", fix)
    if raw["version"] != STATE_VERSION:
        raise CheckpointRefused(f"{file}: driver state version {raw['version']!r} != {STATE_VERSION}", fix)
    try:
        state = DriverState(global_step=int(raw["global_step"]), data_epoch=int(raw["data_epoch"]),
                            data_batch=int(raw["data_batch"]),
                            kl_coef=None if raw["kl_coef"] is None else float(raw["kl_coef"]),
                            python_random=raw["python_random"], config_digest=dict(raw["config_digest"]))
        random.Random().setstate(_python_state_from_json(state.python_random))  # a valid state, or it raises
    except (TypeError, ValueError) as e:
        raise CheckpointRefused(f"{file} holds a malformed value ({type(e).__name__}: {e})", fix) from None
    return state


def _python_state_from_json(data) -> tuple:
    """``random.getstate()`` from its JSON form (lists for tuples)."""
    version, internal, gauss = data
    return (version, tuple(internal), gauss)


def _global_rng_tensors() -> dict[str, torch.Tensor]:
    _name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype("int64")),
            "numpy_meta": torch.tensor([pos, has_gauss], dtype=torch.int64),
            "numpy_cached": torch.tensor([cached], dtype=torch.float64)}


def _restore_global_rng(t: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(t["torch"])
    if "numpy_keys" in t:
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
def _fsync(path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            _fsync(os.path.join(dirpath, f))
        _fsync_dir(dirpath)


def _fsync_dir(path) -> None:
    with contextlib.suppress(OSError):  # some file systems refuse a directory's fsync
        _fsync(path)


def fresh_dir_beside(final: Path) -> Path:
    """A new, empty directory next to ``final`` (``.tmp-<name>-<id>``), made here: nothing in it can be a
    link planted beforehand, so what is written into it lands in it."""
    tmp = final.parent / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _remove_aside(path: Path) -> None:
    """Rename ``path`` (a directory, a file or a link) aside, atomically: never a half-deleted checkpoint that
    looks complete; then remove it without following any link in it."""
    old = path.parent / f".old-{path.name}-{uuid.uuid4().hex[:8]}"
    os.replace(path, old)
    if old.is_symlink() or not old.is_dir():
        old.unlink()
    else:
        shutil.rmtree(old, ignore_errors=True)


def publish_dir(tmp: Path, final: Path) -> None:
    """Put the finished directory ``tmp`` at ``final``; whatever is there is removed aside, never written through."""
    if os.path.lexists(final):
        _remove_aside(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(safe_files.create_new(tmp), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# ============================================================================ the manager
class CheckpointManager:
    """What ``PPOTrainer.fit`` calls: ``cursor = mgr.resume(trainer)`` after the workers started,
    ``mgr.after_step(trainer, cursor, last)`` after every step (saves per ``save_freq`` and at the end)."""

    def __init__(self, cfg, train_dataset=None):
        tr = cfg.trainer
        self.cfg, self.train_dataset = cfg, train_dataset  # the dataset: for the fingerprint of in-memory rows
        self.ignore_fingerprint = bool(getattr(tr, "resume_ignore_fingerprint", False))
        self.root, self.save_freq, self.keep = checkpoint_root(tr), tr.save_freq, tr.max_actor_ckpt_to_keep
        self.resume_mode = tr.resume_mode
        self.resume_from = Path(tr.resume_from_path).expanduser().resolve() if tr.resume_from_path else None
        self.last_saved_step: int | None = None
        self._fingerprint: dict | None = None
        self._checked: tuple | None = None  # prepare_resume()'s result: (path, driver state, async state, what was verified)

    def data_cursor(self) -> DataCursor:
        """The train prompt batches from the start of the data order (``data.seed``, ``data.shuffle``)."""
        d = self.cfg.data
        return DataCursor(self.train_dataset, d.train_batch_size, d.shuffle, d.seed)

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

    def _refusal_fix(self, path: Path) -> str:
        """What to do about a refused checkpoint: resume from the previous complete one by name, or start afresh."""
        step = step_of(path)
        earlier = [p for s, p in list_checkpoints(path.parent, quiet=True) if step is not None and s < step]
        if earlier:
            return (f"to resume from the previous complete checkpoint, rerun with trainer.resume_mode=resume_path "
                    f"trainer.resume_from_path={earlier[-1]} (nothing falls back on its own)")
        return "restore it from a copy, or start afresh with trainer.resume_mode=disable"

    def prepare_resume(self) -> None:
        """Choose the checkpoint ``resume_mode`` selects and check it before Ray starts (``PPOTrainer.start``):
        :func:`verify_checkpoint`, the driver and pipeline state, the keys that must not change, the fingerprint.
        :meth:`resume` uses the result (and calls it itself when nothing did)."""
        path = self.resume_path()
        if path is None:
            self._checked = (None, None, None, "")
            return
        fix = self._refusal_fix(path)
        t0 = time.perf_counter()
        n = verify_checkpoint(path, fix)
        self._check_roles(path, fix)
        state = read_driver_state(path, fix)
        async_state = read_async_state(path, fix) if (path / ASYNC_FILE).is_file() else None
        if async_state is not None and async_state["policy_version"] != state.global_step:
            raise CheckpointRefused(f"{path / ASYNC_FILE} records policy version {async_state['policy_version']}, "
                                    f"the checkpoint step {state.global_step}", fix)
        streamed = self.cfg.trainer.v1.trainer_mode in STREAMED_MODES
        if async_state is not None and not streamed and any(i.batch is None for i in async_state["in_flight"]):
            raise CheckpointRefused(f"{path / ASYNC_FILE} holds a streamed run's prompts (trainer.v1.trainer_mode="
                                    f"colocate_async or separate_async), not generated batches", "resume with "
                                    "one of those trainer.v1.trainer_mode values, or start a new run")
        digest = _config_digest(self.cfg)
        changed = {k: (v, digest.get(k)) for k, v in state.config_digest.items() if digest.get(k) != v}
        if changed:
            raise CheckpointRefused(f"{path}: cannot resume with changed " + ", ".join(
                f"{k} (saved {a!r}, now {b!r})" for k, (a, b) in changed.items()),
                "resume with the saved values, or start a new run (another trainer.default_local_dir)")
        self._check_fingerprint(path)
        self._checked = (path, state, async_state,
                         f"{n} files verified in {time.perf_counter() - t0:.1f}s" if n else "unverified")

    def _check_roles(self, path: Path, fix: str) -> None:
        """The files a resume loads exist: the driver's RNG, the actor's state, the critic's when this run has one."""
        from verl_lite.algorithms import estimator_needs

        needed = [DRIVER_RNG, "actor/dist"]
        if "critic" in estimator_needs(self.cfg.algorithm.adv_estimator):
            needed.append("critic/dist")
        missing = [rel for rel in needed if not (path / rel).exists()]
        if missing:
            raise CheckpointRefused(f"checkpoint {path} lacks {', '.join(missing)}, which this run resumes from"
                                    + (" (this run trains a critic)" if "critic/dist" in missing else ""), fix)

    def fingerprint(self) -> dict:
        """This run's fingerprint (``verl_lite.trainer.fingerprint``), computed once."""
        if self._fingerprint is None:
            from verl_lite.trainer.fingerprint import run_fingerprint

            self._fingerprint = run_fingerprint(self.cfg, self.train_dataset)
        return self._fingerprint

    def _check_fingerprint(self, path: Path) -> None:
        """Refuse a checkpoint of another model, train data or math keys, naming each difference, unless
        ``trainer.resume_ignore_fingerprint``; one without a fingerprint is said."""
        from verl_lite.trainer import fingerprint as fp

        file = path / fp.FILE
        if not file.is_file():
            _say(f"{path} was saved without a fingerprint (an older verl_lite): its model, data and keys are not compared")
            return
        saved = _read_json(path, fp.FILE, self._refusal_fix(path))
        changed = fp.differences(saved, self.fingerprint()) if isinstance(saved, dict) else ["its fingerprint"]
        if changed and self.ignore_fingerprint:
            _say(f"resuming {path} although it differs ({fp.OVERRIDE_KEY}=true): " + "; ".join(changed))
        elif changed:
            raise CheckpointRefused(
                f"{path} was trained by another run; this run differs in " + "; ".join(changed),
                f"start afresh with trainer.resume_mode=disable or another trainer.default_local_dir, or resume it "
                f"anyway with {fp.OVERRIDE_KEY}=true")

    def resume(self, trainer) -> DataCursor:
        """Load the checkpoint ``resume_mode`` selects (if any) into the trainer; return the data cursor."""
        cursor = self.data_cursor()
        if self._checked is None:
            self.prepare_resume()
        (path, state, async_state, verified), self._checked = self._checked, None
        if path is None:
            return cursor
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        infos = {"actor": trainer.actor.call_all("load_checkpoint", str(path / "actor"))}
        if getattr(trainer, "critic", None) is not None:
            infos["critic"] = trainer.critic.call_all("load_checkpoint", str(path / "critic"))
        trainer.global_step = state.global_step
        if trainer.kl_ctrl is not None and state.kl_coef is not None:
            trainer.kl_ctrl.value = state.kl_coef
        random.setstate(_python_state_from_json(state.python_random))
        _restore_global_rng(load_file(str(path / DRIVER_RNG)))
        cursor.epoch, cursor.batch = state.data_epoch, state.data_batch
        trainer.resumed_async_state = async_state  # split placement: its in-flight rollout batches, or None
        self.last_saved_step = trainer.global_step
        layout = infos["actor"][0]["layout"]
        rng = all(i["rng_restored"] for role in infos.values() for i in role)
        _say(f"resumed from {path} (step {trainer.global_step}, saved at layout {layout}; worker RNG "
             f"{'restored' if rng else 'not restored: the layout differs'}; {verified}) in {time.perf_counter() - t0:.1f}s")
        self._say_lr_schedules(trainer.global_step, infos)
        if trainer.global_step >= trainer.total_steps():
            _say(f"the checkpoint is at step {trainer.global_step} of {trainer.total_steps()}: the run had finished, "
                 f"nothing is trained (raise trainer.total_training_steps or trainer.total_epochs to train on); "
                 f"its policy is validated and exported as configured")
        return cursor

    @staticmethod
    def _say_lr_schedules(step: int, infos: dict) -> None:
        """One line per trained role: the LR schedule it continues with (``optim.use_checkpoint_opt_param_scheduler``)."""
        from verl_lite.engine.engine import format_lr_schedule

        for role, ranks in infos.items():
            if ranks and ranks[0].get("lr_schedule"):
                _say(f"{role} resumed at step {step}: {format_lr_schedule(ranks[0]['lr_schedule'])}")

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
        tmp = fresh_dir_beside(final)
        trainer.actor.call_all("save_checkpoint", str(tmp / "actor"), str(tmp / HF_DIR))
        if getattr(trainer, "critic", None) is not None:
            trainer.critic.call_all("save_checkpoint", str(tmp / "critic"))
        state = DriverState(
            global_step=step, data_epoch=cursor.epoch, data_batch=cursor.batch,
            kl_coef=None if trainer.kl_ctrl is None else float(trainer.kl_ctrl.value),
            python_random=list(random.getstate()), config_digest=_config_digest(self.cfg),
        )
        (tmp / DRIVER_STATE).write_text(json.dumps(asdict(state)))
        from verl_lite.trainer.fingerprint import FILE as FINGERPRINT

        (tmp / FINGERPRINT).write_text(json.dumps(self.fingerprint(), indent=1))
        save_file(_global_rng_tensors(), str(tmp / DRIVER_RNG))
        async_state = trainer.source.checkpoint_state(step)  # rollout_stage's sources
        if async_state is not None:  # split placement: the policy version and the batches generated ahead
            torch.save({**async_state, "in_flight": [item.to_state() for item in async_state["in_flight"]]},
                       tmp / ASYNC_FILE)
        _fsync_tree(tmp)
        _write_atomic(tmp / COMPLETE, json.dumps({"global_step": step, "time": time.time(),
                                                  MANIFEST_KEY: build_manifest(tmp)}))
        publish_dir(tmp, final)  # the same step saved again (e.g. a resumed run that trained no further) is replaced
        _write_atomic(self.root / LATEST_FILE, str(step))
        self.last_saved_step = step
        self._retain()
        return final

    def _retain(self) -> None:
        """``trainer.max_actor_ckpt_to_keep``: only the newest complete checkpoints stay."""
        if self.keep is not None:
            for _step, path in list_checkpoints(self.root, quiet=True)[:-self.keep]:
                _remove_aside(path)
