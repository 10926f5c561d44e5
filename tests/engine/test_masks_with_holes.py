"""Response masks with holes (observation tokens inside a multi-turn response, m = 0) through the
worker path: ``ActorRolloutRefWorker.compute_log_prob`` at TP2 keeps every response token in the
sequence, so its log-probs equal HF transformers' (float64) on EVERY response position, holes
included, and the columns stay aligned with the mask."""

from __future__ import annotations

import torch

from .conftest import spawn_ranks

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
RESPONSES = [[12, 13, 14, 15, 16, 17], [18, 19, 20], [21, 22, 23, 24, 25]]
MASKS = [[1, 1, 0, 0, 1, 1], [0, 1, 1, 0, 0, 0], [1, 0, 1, 0, 1, 0]]  # holes and a masked tail


def _worker_log_probs(rank, world, model_dir, port):
    from verl_lite.protocol import Batch
    from verl_lite.config import load_config
    from verl_lite.workers.actor_rollout_ref import ActorRolloutRefWorker
    from verl_lite.workers.from_config import actor_worker_config

    width = max(len(r) for r in RESPONSES)
    responses = torch.zeros(len(RESPONSES), width, dtype=torch.long)
    mask = torch.zeros(len(RESPONSES), width)
    for i, (resp, m) in enumerate(zip(RESPONSES, MASKS)):
        responses[i, : len(resp)] = torch.tensor(resp)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    cfg = load_config([f"actor_rollout_ref.model.path={model_dir}",
                       "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
    worker = ActorRolloutRefWorker(rank, world, actor_worker_config(cfg, total_steps=1, need_ref=False))
    worker.set_rendezvous("127.0.0.1", port)
    worker.init_model()
    piece = Batch.from_dict({"responses": responses, "response_mask": mask}, {"prompt_ids": PROMPTS})
    return worker.compute_log_prob(piece, [[0, 1], [2]], 1.0)


def test_masks_with_holes_match_hf_on_every_response_token(tmp_path):
    import transformers

    from verl_lite.data import save_char_tokenizer
    from verl_lite.utils import make_tiny_hf_model
    from verl_lite.utils.net import free_port

    model_dir = make_tiny_hf_model(tmp_path / "model", vocab_size=104, hidden_size=32, num_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, seed=1)
    save_char_tokenizer(model_dir)
    out = spawn_ranks(_worker_log_probs, 2, str(model_dir), free_port())[0]
    assert out is not None, "TP rank 0 owns the outputs"
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64).eval()
    for i, (prompt, resp, m) in enumerate(zip(PROMPTS, RESPONSES, MASKS)):
        last = max(t for t, v in enumerate(m) if v) + 1  # trailing masked tokens are padding
        ids = torch.tensor([prompt + resp[:last]])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].double(), -1)
        ref = logp[len(prompt) - 1: len(prompt) - 1 + last].gather(-1, torch.tensor(resp[:last])[:, None])[:, 0]
        got = out["log_probs"][i, :last].double()
        assert torch.allclose(got, ref, atol=1e-5, rtol=0), (i, (got - ref).abs().max())
