"""Nothing in a checkpoint, or next to it, can be turned against the run that reads it.

Every case is planted in a copy of a real saved checkpoint (the manifest resealed where the attack would
reseal it too) and must be refused before any process loads it, naming the file and the reason: through
the resume pre-check (``CheckpointManager.prepare_resume``, the function the CLI runs before Ray starts),
four of them through the CLI itself (exit 2, one message, no step, no worker), and through the export
command. Files outside the checkpoint (``victim``) are never read, written, truncated or followed.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import struct
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.checkpoint.conftest import copy_checkpoints, metrics, overrides, reseal, run_refused

PROTO4, TUPLE1, REDUCE, STOP, BUILD, SETITEM, EMPTY_DICT = b"\x80\x04", b"\x85", b"R", b".", b"b", b"s", b"}"
PLANNER = "torch.distributed.checkpoint.planner"
VICTIM_TEXT = "the user's own file\n"


def _s(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _enum_value_build() -> bytes:
    """``WriteItemType(2)`` (the SHARD member) then BUILD ``{'_value_': 999}`` on it: a process-wide change."""
    return (PROTO4 + _s(PLANNER) + _s("WriteItemType") + b"\x93" + b"K\x02" + TUPLE1 + REDUCE
            + EMPTY_DICT + _s("_value_") + b"J" + struct.pack("<i", 999) + SETITEM + BUILD + STOP)


def _class_build() -> bytes:
    """BUILD on the ``WriteItem`` class itself (slot state: setattr on the class)."""
    return (PROTO4 + _s(PLANNER) + _s("WriteItem") + b"\x93" + b"N" + EMPTY_DICT + _s("planted") + b"K\x01"
            + SETITEM + b"\x86" + BUILD + STOP)


def _dist(ckpt: Path) -> Path:
    return ckpt / "actor" / "dist"


def _shard(ckpt: Path) -> Path:
    return sorted(_dist(ckpt).glob("*.distcp"))[0]


def _rewrite_storage(ckpt: Path, **change) -> None:
    """Rewrite one storage entry of the actor's index (e.g. ``relative_path="../../victim"``), pickled as torch does."""
    from verl_lite.engine.checkpoint import read_dist_metadata

    index = read_dist_metadata(_dist(ckpt))
    key = next(iter(index.storage_data))
    index.storage_data[key] = dataclasses.replace(index.storage_data[key], **change)
    (_dist(ckpt) / ".metadata").write_bytes(pickle.dumps(index))


def _safetensors_claiming(path: Path, header_len: int) -> None:
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", header_len) + data[8:])


def _strip_manifest(ckpt: Path) -> None:
    (ckpt / "complete").write_text(json.dumps({"global_step": 2, "time": 0.0}))


def _plant(case: str, ckpt: Path, victim: Path) -> str:
    """Plant ``case`` in ``ckpt``; return the text the refusal must contain."""
    dist = _dist(ckpt)
    if case == "index_parent_path":
        _rewrite_storage(ckpt, relative_path=f"../../../{victim.name}")
        reseal(ckpt)
        return f"{dist / '.metadata'}: storage entry '../../../{victim.name}' is not a file name"
    if case == "index_absolute_path":
        _rewrite_storage(ckpt, relative_path=str(victim))
        reseal(ckpt)
        return f"storage entry '{victim}' is not a file name"
    if case == "index_huge_length":
        _rewrite_storage(ckpt, length=1 << 40)
        reseal(ckpt)
        return f"{dist / '.metadata'}: places {1 << 40} bytes"
    if case == "shard_links_outside":
        shard = _shard(ckpt)
        victim.write_bytes(shard.read_bytes())
        reseal(ckpt)  # the manifest's size and sha256 match the link's target: the link itself is refused
        shard.unlink()
        shard.symlink_to(victim)
        return f"{shard}: a symbolic link"
    if case == "enum_state_change":
        (dist / ".metadata").write_bytes(_enum_value_build())
        reseal(ckpt)
        return "sets the state of WriteItemType"
    if case == "evil_common":
        (dist / "common.pt").write_bytes(pickle.dumps(print))  # a global weights_only refuses
        reseal(ckpt)
        return f"{dist / 'common.pt'}: not a readable common state"
    if case == "planted_async_state":
        (ckpt / "async_pipeline.pt").write_bytes(b"planted")
        return "holds async_pipeline.pt, which its save did not write"
    if case == "sealed_bad_async_state":
        import torch

        torch.save({"policy_version": 2, "in_flight": [{"not": "an item"}]}, ckpt / "async_pipeline.pt")
        reseal(ckpt)
        return "async_pipeline.pt does not hold split placement's pipeline state"
    if case == "safetensors_huge_header":
        _safetensors_claiming(ckpt / "driver_rng.safetensors", 1 << 62)
        reseal(ckpt)
        return f"{ckpt / 'driver_rng.safetensors'}: its header claims {1 << 62} bytes"
    if case == "no_manifest_state_to_dev_zero":
        _strip_manifest(ckpt)
        (ckpt / "driver_state.json").unlink()
        (ckpt / "driver_state.json").symlink_to("/dev/zero")
        return f"{ckpt / 'driver_state.json'}: a symbolic link"
    if case == "no_manifest_state_fifo":
        _strip_manifest(ckpt)
        (ckpt / "driver_state.json").unlink()
        os.mkfifo(ckpt / "driver_state.json")
        return f"{ckpt / 'driver_state.json'}: a FIFO"
    if case == "no_manifest_state_oversized":
        _strip_manifest(ckpt)
        (ckpt / "driver_state.json").write_text(" " * (17 << 20) + "{}")
        return f"{ckpt / 'driver_state.json'}: {(17 << 20) + 2} bytes, more than"
    raise AssertionError(case)


CASES = ("index_parent_path", "index_absolute_path", "index_huge_length", "shard_links_outside", "enum_state_change",
         "evil_common", "planted_async_state", "sealed_bad_async_state", "safetensors_huge_header",
         "no_manifest_state_to_dev_zero", "no_manifest_state_fifo", "no_manifest_state_oversized")
CLI_CASES = ("index_parent_path", "enum_state_change", "planted_async_state", "no_manifest_state_fifo")


def _victim(root: Path) -> Path:
    victim = root / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    return victim


def _case_dir(straight_run, root: Path, case: str) -> tuple[Path, Path, str]:  # noqa: F811
    root.mkdir(parents=True, exist_ok=True)
    victim = _victim(root)
    ckpt = copy_checkpoints(straight_run["ckpt"], root / "ckpt", steps=(2,)) / "global_step_2"
    return ckpt, victim, _plant(case, ckpt, victim)


@pytest.mark.parametrize("case", CASES)
def test_resume_precheck_refuses(case, straight_run, tiny_assets, tmp_path):  # noqa: F811
    """The pre-check the CLI runs before Ray refuses each planted case naming the file and the reason, within a
    bound (a FIFO never blocks it), and leaves the file outside the checkpoint as it was."""
    from verl_lite.config import load_config
    from verl_lite.trainer.checkpointing import CheckpointManager, CheckpointRefused

    ckpt, victim, expected = _case_dir(straight_run, tmp_path, case)
    before = victim.read_bytes()
    manager = CheckpointManager(load_config(overrides(tiny_assets, tmp_path)))
    outcome: dict = {}

    def precheck():
        try:
            manager.prepare_resume()
        except CheckpointRefused as e:
            outcome["refused"] = str(e)

    worker = threading.Thread(target=precheck, daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive(), f"{case}: the pre-check blocked"
    assert expected in outcome.get("refused", ""), (case, outcome)
    assert victim.read_bytes() == before and not victim.is_symlink()


def test_worker_load_checks_the_same(straight_run, tmp_path):  # noqa: F811
    """A worker's load checks the directory itself (``check_dist_dir``), so a caller that skipped the
    pre-check cannot be led outside either."""
    from verl_lite.engine.checkpoint import UnsafeCheckpointFile, check_dist_dir

    fragments = {"index_parent_path": "is not a file name of this directory", "index_huge_length": "places 1099511627776",
                 "evil_common": "not a readable common state", "shard_links_outside": "symbolic links are not followed"}
    for case, fragment in fragments.items():
        ckpt, victim, _expected = _case_dir(straight_run, tmp_path / case, case)
        with pytest.raises(UnsafeCheckpointFile, match=fragment):
            check_dist_dir(_dist(ckpt))
    check_dist_dir(_dist(straight_run["ckpt"] / "global_step_4"))  # a real one passes


@pytest.fixture(scope="module")
def cli_refusals(straight_run, tiny_assets, tmp_path_factory):  # noqa: F811
    """The CLI resume of each CLI_CASES checkpoint, two at a time: case -> (root, victim, its bytes, expected, rc,
    output)."""

    def launch(case):
        root = tmp_path_factory.mktemp(f"cli_{case}")
        ckpt, victim, expected = _case_dir(straight_run, root, case)
        return (root, victim, victim.read_bytes(), expected, *run_refused(overrides(tiny_assets, root), root / "resume.log", timeout=180))

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(CLI_CASES, pool.map(launch, CLI_CASES)))


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_resume_refuses_before_any_worker(case, cli_refusals):
    """Exit 2, one message naming the file, no traceback, no step, no worker started."""
    root, victim, before, expected, rc, text = cli_refusals[case]
    assert rc == 2, text[-3000:]
    assert expected in text and "verl_lite: " in text, text[-3000:]
    assert "Traceback" not in text and "internal error" not in text, text[-3000:]
    assert "worker" not in text.lower().split("fix:")[0], text[-3000:]
    assert not list((root / "out").glob("*/metrics.jsonl")) or not metrics(root / "out")
    assert victim.read_bytes() == before


def test_unpickler_cannot_change_existing_objects(tmp_path):
    """BUILD on an enum member or a class is refused; the same bytes unrestricted do change the member (run in a
    child, so this process stays clean)."""
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from verl_lite.compat.torch_dcp import RestrictedUnpickler

    live = subprocess.run([sys.executable, "-c", "import pickle, sys\nfrom torch.distributed.checkpoint.planner "
                           "import WriteItemType\npickle.loads(sys.stdin.buffer.read())\n"
                           "print(WriteItemType.SHARD._value_)"], input=_enum_value_build(), capture_output=True,
                          timeout=120)
    assert live.stdout.strip() == b"999", live.stderr[-2000:]  # the payload is live unrestricted
    for payload in (_enum_value_build(), _class_build()):
        with pytest.raises(pickle.UnpicklingError, match="sets the state of"):
            RestrictedUnpickler(io.BytesIO(payload)).load()
    assert WriteItemType.SHARD.value == 2 and not hasattr(WriteItem, "planted")


def test_export_never_writes_through_links(straight_run, tmp_path):  # noqa: F811
    """A checkpoint whose huggingface/ holds a link to a file outside: the export is refused and the target
    untouched. An --out directory of the user's holding a link: replaced as a whole, the link's target untouched."""
    from verl_lite.trainer.export import main

    victim = _victim(tmp_path)
    ckpt = copy_checkpoints(straight_run["ckpt"], tmp_path / "ckpt", steps=(2,)) / "global_step_2"
    weights = ckpt / "huggingface" / "model.safetensors"
    weights.unlink()
    weights.symlink_to(victim)
    assert main([str(ckpt)]) == 2
    assert victim.read_text() == VICTIM_TEXT and weights.is_symlink()

    clean = copy_checkpoints(straight_run["ckpt"], tmp_path / "clean", steps=(2,)) / "global_step_2"
    out = tmp_path / "user_out"
    out.mkdir()
    (out / "model.safetensors").symlink_to(victim)
    (out / "config.json").symlink_to(victim)
    assert main([str(clean), "--out", str(out)]) == 0
    assert victim.read_text() == VICTIM_TEXT
    assert not (out / "model.safetensors").is_symlink() and (out / "model.safetensors").stat().st_size > 1000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_lock_file_link_or_fifo_is_refused(tmp_path):
    """A ``.verl_lite.lock`` that is a link is refused (its target keeps its bytes); a FIFO there neither blocks
    the lock nor the holder read."""
    from verl_lite.errors import BadInput
    from verl_lite.trainer.run_lock import LOCK_NAME, RunLock, read_holder

    victim = _victim(tmp_path)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / LOCK_NAME).symlink_to(victim)
    with pytest.raises(BadInput, match="symbolic link"):
        RunLock(linked).acquire()
    assert victim.read_text() == VICTIM_TEXT
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / LOCK_NAME)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(holder=read_holder(fifo / LOCK_NAME)), daemon=True)
    worker.start()
    worker.join(30)
    assert result == {"holder": {}}, "reading a FIFO lock file blocked"
    with pytest.raises(BadInput, match="not a regular file"):
        RunLock(fifo).acquire()
