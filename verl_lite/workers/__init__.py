"""Ray worker roles: thin shells over the engine and the rollout (no RL math)."""

from verl_lite.workers.actor_rollout_ref import ActorRolloutRefWorker, WorkerConfig
from verl_lite.workers.critic import CriticWorker
from verl_lite.workers.engine_worker import EngineWorkerConfig

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "EngineWorkerConfig", "WorkerConfig"]
