"""SFT on the megatron engine: step-1 NLL equals an independent HF float64 computation, a few steps
reduce it, and run_sft writes a loadable HF model. Runs in a subprocess (the engine installs a
process-wide CPU adapter and process groups)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    r"""
    import json, sys, socket, torch
    torch.set_num_threads(1)
    from pathlib import Path
    out = Path(sys.argv[1])
    from verl_lite.utils import make_tiny_hf_model
    from verl_lite.data import save_char_tokenizer, make_synthetic_task, RLDataset
    from verl_lite.trainer.sft import SFTConfig, run_sft, sft_examples, sft_step, _free_port
    from transformers import AutoTokenizer, AutoModelForCausalLM
    d = make_tiny_hf_model(out / "init", "qwen2", vocab_size=128, hidden_size=32, num_layers=2,
                           intermediate_size=64, init_std=0.05, seed=1)
    save_char_tokenizer(d)
    train, val = make_synthetic_task(out / "data", 64, 16, seed=0, max_digits=2)
    tok = AutoTokenizer.from_pretrained(d)
    ex = sft_examples(RLDataset([str(train)], tok, 32), tok)[:24]

    # independent token-mean NLL of the response tokens, HF model, float64, one sequence at a time
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64)
    tot, cnt = 0.0, 0
    with torch.no_grad():
        for p, r in ex:
            logits = hf(input_ids=torch.tensor([p + r])).logits[0]
            lp = torch.log_softmax(logits, -1)
            for t, tokid in enumerate(r):
                tot -= lp[len(p) + t - 1, tokid].item(); cnt += 1
    ref_nll = tot / cnt

    from verl_lite.engine import MegatronEngine, init_distributed
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig
    from verl_lite.engine.distributed import destroy_distributed
    init_distributed(0, 1, "127.0.0.1", _free_port(), MegatronConfig.layout())
    eng = MegatronEngine(EngineConfig(model_path=str(d), optim=OptimConfig(lr=1e-2, weight_decay=0.0), total_steps=8))
    nlls = [sft_step(eng, ex, micro_batch_size=5)["nll"] for _ in range(8)]  # 5 uneven micro-batches
    destroy_distributed()

    summary = run_sft(SFTConfig(model_path=str(d), out_dir=str(out / "sft"), train_files=[str(train)],
                                val_files=[str(val)], steps=4, batch_size=16, micro_batch_size=8, lr=1e-2,
                                eval_every=2, log=False))
    print("RESULT" + json.dumps({"ref_nll": ref_nll, "nlls": nlls, "summary_steps": summary["steps"],
                                 "evals": [h["step"] for h in summary["history"]],
                                 "acc": summary["final_val_accuracy"]}))
    """
)


def test_sft_on_engine_reduces_nll_and_writes_model(tmp_path):
    pytest.importorskip("megatron.core")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
    res = json.loads(line[len("RESULT"):])
    # step 1's reported NLL is computed before the update: it must equal the independent value
    assert res["nlls"][0] == pytest.approx(res["ref_nll"], rel=1e-4)
    assert res["nlls"][-1] < 0.8 * res["nlls"][0], res["nlls"]
    assert res["summary_steps"] == 4 and res["evals"] == [2, 4]
    assert 0.0 <= res["acc"] <= 1.0
    out = tmp_path / "sft"
    for f in ("config.json", "model.safetensors", "tokenizer.json", "sft_summary.json"):
        assert (out / f).is_file(), f
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True,
                                   tokenize=False) == "<|user|>1+1=<|assistant|>"
