"""Damaged checkpoints are refused, naming the file, before anything reads them.

Each save records the size and sha256 of every file in its ``complete`` marker (the manifest,
written atomically and last). Checked here against hashlib run independently on a real saved
checkpoint, then through the CLI: 4 KiB of 0xFF in a shard, a half-truncated shard and a
``driver_state.json`` that is not JSON each stop the resume with exit 2 and one message naming the
file, before Ray starts, with no step trained or logged; the export command refuses a damaged shard
the same way. Nothing falls back to an older checkpoint on its own: the message names it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.checkpoint.conftest import copy_checkpoints, export_cli, metrics, overrides, reseal, run_refused


def _shards(ckpt: Path) -> list[Path]:
    return sorted((ckpt / "actor" / "dist").glob("*.distcp"))


def _no_step_ran(out_dir: Path) -> bool:
    return not list(out_dir.glob("*/metrics.jsonl")) or not metrics(out_dir)


def _assert_refused(rc: int, text: str, *needles: str) -> None:
    assert rc == 2, f"rc={rc}\n{text[-3000:]}"
    for needle in needles:
        assert needle in text, f"{needle!r} not in:\n{text[-3000:]}"
    assert "Traceback" not in text and "internal error" not in text, text[-3000:]


def test_manifest_lists_every_file_with_its_sha256(straight_run):
    ckpt = straight_run["ckpt"] / "global_step_4"
    files = json.loads((ckpt / "complete").read_text())["files"]
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != "complete")
    assert sorted(files) == on_disk and any(r.endswith(".distcp") for r in on_disk) and "driver_state.json" in files
    for rel, rec in files.items():
        data = (ckpt / rel).read_bytes()
        assert rec == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel


def _flipped_bytes(straight_run, tiny_assets, tmp_path):
    """4 KiB of 0xFF inside a shard of the newest checkpoint (resumed automatically; the run would train
    steps 5-6 from it)."""
    root = copy_checkpoints(straight_run["ckpt"], tmp_path / "ckpt", steps=(2, 4))
    shard = _shards(root / "global_step_4")[0]
    data = bytearray(shard.read_bytes())
    data[1024:1024 + 4096] = b"\xff" * 4096
    shard.write_bytes(bytes(data))
    return overrides(tiny_assets, tmp_path, **{"trainer.total_training_steps": 6}), {"root": root, "shard": shard}


def _truncated_shard(straight_run, tiny_assets, tmp_path):
    root = copy_checkpoints(straight_run["ckpt"], tmp_path / "ckpt", steps=(2,))
    ckpt = root / "global_step_2"
    shard = _shards(ckpt)[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) // 2])
    args = overrides(tiny_assets, tmp_path, **{"trainer.resume_mode": "resume_path",
                                               "trainer.resume_from_path": str(ckpt)})
    return args, {"ckpt": ckpt, "shard": shard, "size": len(data)}


def _malformed_driver_state(straight_run, tiny_assets, tmp_path):
    """A driver_state.json that is not JSON (its manifest entry matching: as a buggy save would leave it)."""
    root = copy_checkpoints(straight_run["ckpt"], tmp_path / "ckpt", steps=(2,))
    state = root / "global_step_2" / "driver_state.json"
    state.write_text(state.read_text()[:40])
    reseal(root / "global_step_2")
    return overrides(tiny_assets, tmp_path), {"state": state}


DAMAGES = {"flipped": _flipped_bytes, "truncated": _truncated_shard, "driver_state": _malformed_driver_state}


@pytest.fixture(scope="module")
def refused(straight_run, tiny_assets, tmp_path_factory):
    """Each damaged checkpoint's CLI resume (and the flipped one's export), the three at once (each stops at pre-flight: one Python
    start-up, mostly one core's work); name -> (tmp dir, exit code, output, what the damage touched)."""
    from concurrent.futures import ThreadPoolExecutor

    def launch(name):
        tmp = tmp_path_factory.mktemp(name)
        args, info = DAMAGES[name](straight_run, tiny_assets, tmp)
        rc, text = run_refused(args, tmp / "resume.log")
        if name == "flipped":  # the export command on the same damaged checkpoint
            info["export"] = export_cli(str(info["root"] / "global_step_4"), "--out", str(tmp / "exported"))
        return tmp, rc, text, info

    with ThreadPoolExecutor(max_workers=len(DAMAGES)) as pool:
        return dict(zip(DAMAGES, pool.map(launch, DAMAGES)))


def test_flipped_bytes_in_a_shard_refuse_the_resume(refused):
    """4 KiB of 0xFF in a shard of the newest checkpoint: refused naming the shard, and the message names
    the previous checkpoint; the export command refuses it too."""
    tmp_path, rc, text, info = refused["flipped"]
    root, shard = info["root"], info["shard"]
    rel = shard.relative_to(root / "global_step_4").as_posix()
    _assert_refused(rc, text, f"checkpoint {root / 'global_step_4'} is damaged: {rel} does not match the sha256",
                    f"trainer.resume_from_path={root / 'global_step_2'}")
    assert _no_step_ran(tmp_path / "out")

    res = info["export"]
    assert res.returncode == 2 and f"is damaged: {rel} does not match the sha256" in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and not (tmp_path / "exported").exists()


def test_truncated_shard_refuses_the_resume(refused):
    tmp_path, rc, text, info = refused["truncated"]
    ckpt, shard, size = info["ckpt"], info["shard"], info["size"]
    rel = shard.relative_to(ckpt).as_posix()
    _assert_refused(rc, text, f"checkpoint {ckpt} is damaged: {rel} is {size // 2} bytes where the save wrote "
                              f"{size} (truncated or overwritten)")
    assert _no_step_ran(tmp_path / "out")


def test_malformed_driver_state_is_named(refused):
    """A driver_state.json that is not JSON (its manifest entry matching: as a buggy save would leave it)."""
    tmp_path, rc, text, info = refused["driver_state"]
    _assert_refused(rc, text, f"{info['state']} is unreadable (JSONDecodeError")
    assert _no_step_ran(tmp_path / "out")


def test_checkpoint_without_manifest_is_loaded_unverified(tmp_path, capsys):
    """A checkpoint saved before manifests existed is not refused; resume says its files are unverified."""
    from verl_lite.trainer.checkpointing import verify_checkpoint

    (tmp_path / "complete").write_text(json.dumps({"global_step": 2, "time": 0.0}))
    assert verify_checkpoint(tmp_path) == 0
    assert "saved without checksums" in capsys.readouterr().err
