"""Mixture-of-experts: what is accepted before start and what is rejected with one clear reason, the
megatron settings derived from HF's MoE configs, and the rollout's weight sync into HF's fused experts.
(Numerical parity of every MoE layout is in tests/parity/test_moe_parity.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verl_lite.config import ConfigError, default_model_path, load_config, validate_config

M = "actor_rollout_ref.actor.megatron"


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from verl_lite.utils.tiny_model import make_tiny_moe_model

    from verl_lite.data import save_char_tokenizer

    root = tmp_path_factory.mktemp("moe_cfg")
    out = {}
    for arch in ("qwen3_moe", "qwen2_moe"):
        out[arch] = str(make_tiny_moe_model(root / arch, arch, vocab_size=104, num_layers=2, seed=2))
        save_char_tokenizer(out[arch])
    return out


def _problems(overrides, world_size) -> list[str]:
    try:
        validate_config(load_config(overrides), world_size=world_size)
    except ConfigError as e:
        return list(e.problems)
    return []


def test_moe_layout_and_router_losses_are_accepted(moe_dirs):
    ok = [f"actor_rollout_ref.model.path={moe_dirs['qwen3_moe']}", f"{M}.expert_model_parallel_size=2",
          f"{M}.tensor_model_parallel_size=2", f"{M}.sequence_parallel=true",
          f"+{M}.override_transformer_config.moe_aux_loss_coeff=0.01",
          f"+{M}.override_transformer_config.moe_z_loss_coeff=0.001"]
    assert _problems(ok, world_size=4) == []


@pytest.mark.parametrize("overrides,world,needle", [
    ([f"{M}.expert_model_parallel_size=8"], 8, "must divide the model's 4 experts"),
    ([f"{M}.expert_model_parallel_size=4"], 2, "must divide the 2 ranks of a pipeline stage"),
    ([f"{M}.expert_tensor_parallel_size=2"], 2, "expert tensor parallelism is not built"),
    ([f"{M}.tensor_model_parallel_size=2"], 2, "needs sequence_parallel=true"),
    ([f"+{M}.override_transformer_config.moe_aux_loss_coeff=-1"], 1, "must be a number >= 0"),
    ([f"+{M}.override_transformer_config.moe_grouped_gemm=true"], 1, "only moe_aux_loss_coeff and moe_z_loss_coeff"),
])
def test_bad_moe_settings_are_rejected_with_a_reason(moe_dirs, overrides, world, needle):
    problems = _problems([f"actor_rollout_ref.model.path={moe_dirs['qwen3_moe']}", *overrides], world)
    assert any(needle in p for p in problems), problems


@pytest.mark.parametrize("recompute", ["actor_rollout_ref.model.enable_gradient_checkpointing=true",
                                       f"+{M}.override_transformer_config.recompute_granularity=full"])
def test_router_losses_with_recompute_are_rejected_before_start(moe_dirs, monkeypatch, recompute):
    """On GPU (where recompute is otherwise accepted) router losses + recompute fail before start, not at step 1."""
    import verl_lite.config.validate as validate

    monkeypatch.setattr(validate, "_cuda_visible", lambda: True)
    base = [f"actor_rollout_ref.model.path={moe_dirs['qwen3_moe']}", recompute]
    assert not any("router losses" in p for p in _problems(base, 1))
    problems = _problems([*base, f"+{M}.override_transformer_config.moe_z_loss_coeff=0.001"], 1)
    assert any("MoE router losses under recompute are not built" in p for p in problems), problems


def test_dense_model_rejects_expert_parallelism_and_router_losses():
    if not Path(default_model_path(), "config.json").is_file():
        pytest.skip("shipped model not built yet (scripts/make_tiny_model.py)")
    problems = _problems([f"{M}.expert_model_parallel_size=2",
                          f"+{M}.override_transformer_config.moe_z_loss_coeff=0.001"], world_size=2)
    assert any("expert_model_parallel_size=2" in p and "is dense" in p for p in problems), problems
    assert any("moe_z_loss_coeff" in p and "no router" in p for p in problems), problems


def test_megatron_settings_follow_hf_routing(moe_dirs):
    from transformers import AutoConfig

    from verl_lite.engine.config import MegatronConfig
    from verl_lite.engine.model import moe_settings

    q3 = moe_settings(AutoConfig.from_pretrained(moe_dirs["qwen3_moe"]), MegatronConfig.layout(ep=2))
    assert (q3["num_moe_experts"], q3["moe_router_topk"], q3["moe_ffn_hidden_size"]) == (4, 2, 16)
    assert q3["moe_router_pre_softmax"] is False  # norm_topk_prob: softmax over the k logits = renormalised
    assert q3["moe_shared_expert_intermediate_size"] is None and q3["expert_model_parallel_size"] == 2
    assert q3["moe_aux_loss_coeff"] == 0.0 and q3["moe_z_loss_coeff"] is None  # megatron's own losses off
    q2 = moe_settings(AutoConfig.from_pretrained(moe_dirs["qwen2_moe"]), MegatronConfig.layout())
    assert q2["moe_router_pre_softmax"] is True  # no renormalisation
    assert q2["moe_shared_expert_intermediate_size"] == 24 and q2["moe_shared_expert_gate"] is True


def test_rollout_weight_sync_fills_hf_fused_experts(moe_dirs):
    """export_hf yields checkpoint names (one tensor per expert projection); transformers 5 keeps experts
    fused in memory. Loading a checkpoint-format state dict into a zeroed model restores every weight."""
    import transformers
    from safetensors.torch import load_file

    from verl_lite.rollout.hf_rollout import HFRollout

    path = moe_dirs["qwen2_moe"]
    rollout = HFRollout.__new__(HFRollout)
    rollout.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = {k: v.clone() for k, v in rollout.model.state_dict().items()}
    with torch.no_grad():
        for p in rollout.model.parameters():
            p.zero_()
    checkpoint = load_file(f"{path}/model.safetensors")
    assert any(".mlp.experts.3.down_proj.weight" in k for k in checkpoint)
    rollout.load_weights(checkpoint.items(), strict=True)
    for k, v in rollout.model.state_dict().items():
        assert torch.equal(v, want[k]), k
