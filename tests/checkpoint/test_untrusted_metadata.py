"""A crafted dist-checkpoint index (``.metadata``, the one pickle in a checkpoint) never runs code.

Each bypass form below is a pickle that, unpickled without restriction, runs ``touch <marker>``
(checked first, so every form is live). Through the restricted unpickler it is refused naming what
it refers to, and the marker never appears: in-process (the unpickler itself, and torch's reader as
the workers use it), through the export command for every form (its entry point in this process;
two forms as ``python -m verl_lite.trainer.export``), and through a CLI resume for two forms. The crafted checkpoints are copies of a real saved one whose manifest is
rewritten to match (as someone crafting a whole directory would), so the unpickler is what refuses.
"""

from __future__ import annotations

import io
import os
import pickle
import shlex
import time
from pathlib import Path

import pytest
import torch

from tests.checkpoint.conftest import copy_checkpoints, export_cli, metrics, overrides, reseal, run_refused

PROTO4 = b"\x80\x04"
TUPLE1, TUPLE2, TUPLE3, REDUCE, STOP, MEMOIZE, STACK_GLOBAL = b"\x85", b"\x86", b"\x87", b"R", b".", b"\x94", b"\x93"
FS, MD = "torch.distributed.checkpoint.filesystem", "torch.distributed.checkpoint.metadata"  # once allowed by prefix


def _s(text: str) -> bytes:
    """SHORT_BINUNICODE: push a str."""
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _stack_global(module: str, name: str) -> bytes:
    return _s(module) + _s(name) + STACK_GLOBAL


def _call1(callable_ops: bytes, arg: bytes) -> bytes:
    return callable_ops + arg + TUPLE1 + REDUCE


class _ReduceToSystem:
    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def _payloads(marker: Path) -> dict[str, bytes]:
    """Each known way to make an unpickler call something; every one runs ``touch marker`` when unrestricted."""
    cmd = f"touch {shlex.quote(str(marker))}"
    return {
        # protocol 4 resolves a dotted name attribute by attribute: filesystem.os.system
        "dotted_name": PROTO4 + _call1(_stack_global(FS, "os.system"), _s(cmd)) + STOP,
        # nested attributes through an allowed module: metadata.torch.os.system
        "nested_attribute": PROTO4 + _call1(_stack_global(MD, "torch.os.system"), _s(cmd)) + STOP,
        # STACK_GLOBAL whose names come from the memo (no string next to the opcode)
        "stack_global_memo": PROTO4 + _s("os") + MEMOIZE + _s("system") + MEMOIZE + b"h\x00h\x01" + STACK_GLOBAL
        + _s(cmd) + TUPLE1 + REDUCE + STOP,
        # the text GLOBAL opcode ('c' module\nname\n) under a protocol-4 header: dotted lookup too
        "text_global": PROTO4 + _call1(f"c{FS}\nos.system\n".encode(), _s(cmd)) + STOP,
        # protocol 0 INST: MARK, args, 'i' module\nname\n builds by calling the global
        "inst_opcode": b"(V" + cmd.encode() + b"\nios\nsystem\n" + STOP,
        # an object whose __reduce__ returns os.system (what pickle.dumps writes for it)
        "reduce_gadget": pickle.dumps(_ReduceToSystem(cmd)),
        # copyreg._reconstructor(Popen, Popen, argv) runs Popen.__init__(argv)
        "copyreg_gadget": PROTO4 + _stack_global("copyreg", "_reconstructor") + _stack_global("subprocess", "Popen")
        + _stack_global("subprocess", "Popen") + b"](" + _s("touch") + _s(str(marker)) + b"e" + TUPLE3 + REDUCE
        + STOP,
        # builtins.getattr on a module reached through an allowed module: getattr(filesystem.os, 'system')
        "builtins_getattr": PROTO4 + _stack_global("builtins", "getattr") + _stack_global(FS, "os") + _s("system")
        + TUPLE2 + REDUCE + _s(cmd) + TUPLE1 + REDUCE + STOP,
    }


FORMS = sorted(_payloads(Path("m")))
RESUME_FORMS = ("dotted_name", "copyreg_gadget")


def _appears(path: Path, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists():
            return True
        time.sleep(0.05)
    return path.exists()


def _crafted_checkpoint(straight_run, root: Path, form: str, marker: Path, step: int = 2) -> Path:
    """A copy of the real step-``step`` checkpoint whose actor index is the ``form`` payload, manifest resealed."""
    ckpt = copy_checkpoints(straight_run["ckpt"], root, steps=(step,)) / f"global_step_{step}"
    (ckpt / "actor" / "dist" / ".metadata").write_bytes(_payloads(marker)[form])
    reseal(ckpt)
    return ckpt


def test_every_form_is_live_unrestricted(tmp_path):
    """The payloads really run their command when unpickled without restriction (else the tests below prove nothing)."""
    for form in FORMS:
        marker = tmp_path / f"live_{form}"
        pickle.loads(_payloads(marker)[form])
        assert _appears(marker, timeout=10), f"{form}: the payload did not run unrestricted"


@pytest.mark.parametrize("form", FORMS)
def test_restricted_unpickler_refuses(form, tmp_path):
    """The unpickler, and torch's reader as a worker's load uses it, refuse every form; nothing runs."""
    from torch.distributed.checkpoint import FileSystemReader

    from verl_lite.engine.checkpoint import (
        RestrictedUnpickler,
        UnsafeCheckpointFile,
        read_dist_metadata,
        restricted_metadata_unpickling,
    )

    marker = tmp_path / "marker"
    payload = _payloads(marker)[form]
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle"):
        RestrictedUnpickler(io.BytesIO(payload)).load()
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(UnsafeCheckpointFile, match=r"\.metadata: checkpoint metadata refers to .*refusing"):
        read_dist_metadata(tmp_path)
    with restricted_metadata_unpickling(), pytest.raises(Exception, match="refusing to unpickle"):
        FileSystemReader(str(tmp_path)).read_metadata()
    assert not _appears(marker, timeout=0.2), f"{form} ran its payload"


def test_real_metadata_still_loads(straight_run):
    """The allow-list holds every global a real checkpoint's index refers to (a DP2 save with optimizer)."""
    from verl_lite.engine.checkpoint import read_dist_metadata

    md = read_dist_metadata(straight_run["ckpt"] / "global_step_4" / "actor" / "dist")
    assert md.state_dict_metadata and all(isinstance(v.size, torch.Size) for v in md.state_dict_metadata.values()
                                          if hasattr(v, "size"))


def _assert_export_refused(rc: int, stderr: str, ckpt: Path, out: Path, marker: Path, form: str) -> None:
    assert rc == 2, (form, rc, stderr[-3000:])
    assert f"verl_lite export: {ckpt / 'actor' / 'dist' / '.metadata'}: checkpoint metadata refers to" in stderr, \
        (form, stderr[-3000:])
    assert "Traceback" not in stderr and not out.exists(), (form, stderr[-3000:])
    assert not _appears(marker, timeout=0.2), f"export ran the {form} payload"


def test_export_refuses_every_form(straight_run, tmp_path, capsys):
    """The export command on each crafted checkpoint: exit 2, one line naming the index and the global, no
    traceback, no marker, no export written. Every form through its entry point in this process (a payload
    that ran would run here), two through ``python -m verl_lite.trainer.export``."""
    from verl_lite.trainer.export import main

    for form in FORMS:
        marker, out = tmp_path / f"marker_{form}", tmp_path / f"out_{form}"
        ckpt = _crafted_checkpoint(straight_run, tmp_path / form, form, marker)
        rc = main([str(ckpt), "--out", str(out)])
        _assert_export_refused(rc, capsys.readouterr().err, ckpt, out, marker, form)
    from concurrent.futures import ThreadPoolExecutor

    cli_forms = ("dotted_name", "text_global")
    with ThreadPoolExecutor(max_workers=len(cli_forms)) as pool:  # both commands at once
        results = pool.map(lambda f: export_cli(str(tmp_path / f / "global_step_2"), "--out",
                                                str(tmp_path / f"cli_out_{f}")), cli_forms)
    for form, res in zip(cli_forms, results):
        marker, out = tmp_path / f"marker_{form}", tmp_path / f"cli_out_{form}"
        ckpt = tmp_path / form / "global_step_2"
        _assert_export_refused(res.returncode, res.stderr, ckpt, out, marker, form)


@pytest.fixture(scope="module")
def resumes(straight_run, tiny_assets, tmp_path_factory):
    """The CLI resume from each RESUME_FORMS checkpoint, both at once (each stops at pre-flight: one Python
    start-up, mostly one core's work); form -> (tmp dir, marker, checkpoint, exit code, output)."""
    from concurrent.futures import ThreadPoolExecutor

    def launch(form):
        tmp = tmp_path_factory.mktemp(f"resume_{form}")
        marker = tmp / "marker"
        ckpt = _crafted_checkpoint(straight_run, tmp / "ckpt", form, marker)
        return (tmp, marker, ckpt, *run_refused(overrides(tiny_assets, tmp), tmp / "resume.log"))

    with ThreadPoolExecutor(max_workers=len(RESUME_FORMS)) as pool:
        return dict(zip(RESUME_FORMS, pool.map(launch, RESUME_FORMS)))


@pytest.mark.parametrize("form", RESUME_FORMS)
def test_resume_refuses_before_anything_runs(form, resumes):
    """A CLI resume from a crafted checkpoint stops with one message naming the index (exit 2) before Ray
    or any worker starts; no step runs, and the marker never appears."""
    tmp_path, marker, ckpt, rc, text = resumes[form]
    assert rc == 2, text[-3000:]
    assert f"verl_lite: {ckpt / 'actor' / 'dist' / '.metadata'}: checkpoint metadata refers to" in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert not list((tmp_path / "out").glob("*/metrics.jsonl")) or not metrics(tmp_path / "out")
    assert not _appears(marker, timeout=0.5), f"resume ran the {form} payload"
