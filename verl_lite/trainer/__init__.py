"""The PPO loop (ppo_trainer.PPOTrainer), the main job (main_ppo), SFT warm-start (sft)."""
