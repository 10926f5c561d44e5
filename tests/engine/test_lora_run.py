"""A LoRA PPO run through the Python API (the same trainer as the CLI): with the KL loss and the KL in
reward on, no reference engine exists on any actor worker (its reference log-probs come from the actor
with the adapters off, so no second copy of the weights is held), the KL metrics are finite, and the
exported policy's PEFT adapter loaded onto the base model gives the merged model's logits, as does the offline
export's adapter through ``AutoPeftModelForCausalLM`` (its config names the base model)."""

from __future__ import annotations

import math

import torch

from tests.e2e.conftest import shared_ray  # noqa: F401  (fixture)


def test_lora_run_uses_the_actor_as_reference_and_exports_a_peft_adapter(tmp_path, shared_ray):
    import peft
    import transformers

    from verl_lite.config import load_config
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
                       "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true",
                       "actor_rollout_ref.actor.optim.lr=2e-3", f"trainer.output_dir={tmp_path}",
                       f"trainer.default_local_dir={tmp_path / 'ckpt'}"])
    assert cfg.actor_rollout_ref.model.lora.rank == 8 and cfg.actor_rollout_ref.model.lora.alpha == 16
    with PPOTrainer(cfg) as trainer:
        cursor = trainer._train_batches()
        rows = next(iter(cursor))
        metrics = [trainer.step(iter([rows])) for _ in range(2)]
        engines = trainer.actor.call_all("engines")
        trainer.save_pretrained(tmp_path / "hf")
        checkpoint = trainer.checkpoints.save(trainer, cursor)
    assert engines and all(e["ref"] is None and e["ref_is_actor_without_adapters"] and e["actor"] > 0 for e in engines)
    kl = {k: v for k, v in metrics[1].items() if "kl" in k.lower() and isinstance(v, float)}
    assert kl and all(math.isfinite(v) for v in kl.values()), kl
    assert any(abs(v) > 0 for v in kl.values()), kl  # the adapters moved the policy away from the base

    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
    base = transformers.AutoModelForCausalLM.from_pretrained(cfg.actor_rollout_ref.model.path, dtype=torch.float64)
    ids = torch.randint(3, merged.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "hf" / "lora_adapter"))(ids).logits
        want = merged(ids).logits
    assert float((adapted - want).abs().max()) < 1e-5
    assert float((before - want).abs().max()) > 1e-4

    # the offline export's adapter names its base: AutoPeftModelForCausalLM loads it with nothing else given
    from verl_lite.trainer.export import export_checkpoint

    exported = export_checkpoint(checkpoint, tmp_path / "export")
    auto = peft.AutoPeftModelForCausalLM.from_pretrained(str(exported / "lora_adapter"), dtype=torch.float64)
    with torch.no_grad():
        assert float((auto(ids).logits - want).abs().max()) < 1e-5
