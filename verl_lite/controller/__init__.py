"""Single controller: Ray resource pools, worker groups, dispatch/collect, micro-batch planning. The names below
load on first use (PEP 562), so importing ``verl_lite.controller.config`` does not import Ray."""

from importlib import import_module

_EXPORTS = {
    "dispatch": ("RankLayout", "Shards", "collect_from_owners", "make_layouts", "per_rank_args", "shard_by_plan",
                 "shard_evenly"),
    "planning": ("plan_micro_batches",),
    "local_ray": ("start_ray", "stop_ray"),
    "resource_pool": ("ResourcePool",),
    "role_group": ("MicroBatching", "RoleGroup", "start_roles"),
    "worker_group": ("NodeLostError", "Worker", "WorkerError", "WorkerGroup"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
