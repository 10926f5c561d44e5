"""HF export: the ``huggingface/`` directory of a checkpoint loads with AutoModelForCausalLM and its
log-probs on a held-out batch equal the engine's (the engine reading the checkpoint's shards at TP2,
not the export) within 1e-5; the after-the-fact export command writes the same tensors (crafted and
damaged checkpoints: test_untrusted_metadata, test_integrity)."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.checkpoint.conftest import REPO, hf_weights
from tests.engine.conftest import spawn_ranks, use_layout

TOL = 1e-5


def _batch(vocab: int, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    lengths, responses = [9, 13, 7, 11], [4, 6, 3, 5]
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths], torch.tensor(responses)


def _engine_log_probs(rank, world_size, model_path, dist_dir, vocab):
    from verl_lite.engine.config import EngineConfig, MegatronConfig
    from verl_lite.engine.engine import MegatronEngine, SequenceBatch

    par = MegatronConfig.layout(tp=2)
    use_layout(rank, world_size, par)
    engine = MegatronEngine(EngineConfig(model_path=model_path, megatron=par, forward_only=True))
    engine.load_checkpoint(dist_dir)  # the trained weights, resharded from DP2 into TP2
    ids, resp = _batch(vocab)
    out = engine.infer(SequenceBatch(ids, resp), [[0, 1], [2, 3]], outputs=("log_probs",))
    return None if out is None else out["log_probs"]


def _hf_log_probs(model, ids, resp):
    rows = []
    width = int(resp.max())
    for x, r in zip(ids, resp.tolist()):
        with torch.no_grad():
            logits = model(x[None]).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        targets = x[len(x) - r:]
        got = lp[len(x) - r - 1:len(x) - 1].gather(-1, targets[:, None])[:, 0]
        rows.append(torch.nn.functional.pad(got, (0, width - r)))
    return torch.stack(rows)


def test_hf_export_loads_and_matches_engine(straight_run, tiny_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = straight_run["ckpt"] / "global_step_4"
    hf_dir = ckpt / "huggingface"
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()
    AutoTokenizer.from_pretrained(str(hf_dir))  # the tokenizer travels with the weights
    initial = AutoModelForCausalLM.from_pretrained(tiny_assets["model"], torch_dtype=torch.float32)
    assert any(not torch.equal(a, b) for a, b in zip(model.state_dict().values(), initial.state_dict().values())), \
        "the export holds the initial weights, not the trained ones"
    vocab = model.config.vocab_size
    ids, resp = _batch(vocab)
    ref = _hf_log_probs(model, ids, resp)
    results = spawn_ranks(_engine_log_probs, 2, tiny_assets["model"], str(ckpt / "actor" / "dist"), vocab)
    engine = results[0]
    mask = torch.arange(ref.shape[1])[None] < resp[:, None]
    assert (engine.double() - ref).abs()[mask].max() <= TOL


def test_export_command_after_the_fact(straight_run, tmp_path):
    out = tmp_path / "exported"
    # a directory that is no checkpoint: refused (started first, it runs beside the export below)
    bad = subprocess.Popen([sys.executable, "-m", "verl_lite.trainer.export", str(tmp_path)], cwd=REPO,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    res = subprocess.run([sys.executable, "-m", "verl_lite.trainer.export", str(straight_run["ckpt"]), "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    _, bad_err = bad.communicate(timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"exported step 4 ({straight_run['ckpt'] / 'global_step_4'}, actor saved at tp=1 pp=1 vpp=1 cp=1 dp=2 ep=1)" in res.stdout
    assert "model.safetensors" in res.stdout  # the layout it wrote: one unsharded HF directory
    got, ref = hf_weights(out), hf_weights(straight_run["ckpt"] / "global_step_4" / "huggingface")
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()

    assert bad.returncode == 2 and "neither a complete global_step_K checkpoint" in bad_err
