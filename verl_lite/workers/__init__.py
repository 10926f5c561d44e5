"""Ray worker roles: thin shells over the engine and the rollout (no RL math)."""

from verl_lite.workers.actor_rollout_ref import ActorRolloutRefWorker, WorkerConfig

__all__ = ["ActorRolloutRefWorker", "WorkerConfig"]
