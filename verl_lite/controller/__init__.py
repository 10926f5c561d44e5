"""Single controller: Ray resource pools, worker groups, dispatch/collect, micro-batch planning."""

from verl_lite.controller.dispatch import RankLayout, Shards, collect_from_owners, make_layouts, per_rank_args, shard_by_plan, shard_evenly
from verl_lite.controller.planning import plan_micro_batches
from verl_lite.controller.local_ray import start_ray, stop_ray
from verl_lite.controller.resource_pool import ResourcePool
from verl_lite.controller.role_group import MicroBatching, RoleGroup, start_roles
from verl_lite.controller.worker_group import NodeLostError, Worker, WorkerError, WorkerGroup

__all__ = [
    "RankLayout", "Shards", "collect_from_owners", "make_layouts", "per_rank_args", "shard_by_plan", "shard_evenly",
    "plan_micro_batches", "MicroBatching", "ResourcePool", "RoleGroup", "start_roles", "start_ray", "stop_ray", "NodeLostError", "Worker", "WorkerError", "WorkerGroup",
]
