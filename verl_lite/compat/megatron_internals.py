"""megatron-core 0.16.1 internals verl_lite relies on (see the package docstring).

- :func:`apply_timeout_to_groups`: megatron creates its expert-data-parallel gloo groups without
  the timeout it was given (``parallel_state.py:1278``); every group gets it here.
- :func:`prepare_host_dispatch` / :func:`make_dispatchers_host_safe`: the MoE alltoall token
  dispatcher's device-to-host copy stream and its synchronise step, on a CPU-only torch.
- :func:`torch_adam_step_fix` / :func:`unshare_adam_steps`: loading the distributed optimizer's
  ``fully_reshardable`` state into torch's Adam (no Apex/TE).
- :func:`in_process_save_results`: the torch_dist save writer's result queue without a spawned
  ``multiprocessing`` manager process, for synchronous saves.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta

import torch
import torch.distributed as dist

from verl_lite.compat import require

require("megatron-core", "verl_lite.compat.megatron_internals")


def apply_timeout_to_groups(timeout: timedelta) -> None:
    """Give every group megatron created the timeout: megatron 0.16.1 creates its expert-data-parallel
    gloo groups without one (``parallel_state.py:1278``), which would leave them at 30 minutes."""
    from megatron.core import parallel_state

    for group in parallel_state._global_process_group_list or []:
        if group is not None:  # None stands for the default group, created with the timeout
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def prepare_host_dispatch() -> None:
    """Before building MoE layers on a CPU-only torch: megatron's alltoall dispatcher creates a class-level
    device-to-host copy stream (``torch.cuda.Stream()``) unless one exists; give it a placeholder.
    No-op with CUDA."""
    if torch.cuda.is_available():
        return
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NO_STREAM


def make_dispatchers_host_safe(model) -> None:
    """After building on a CPU-only torch: the alltoall dispatchers' copy-to-host + stream synchronise step
    runs without streams (``_HostDtoH``: the split sizes become numpy arrays, as megatron's copy makes
    them; there is nothing to copy or wait for). No-op with CUDA."""
    if torch.cuda.is_available():
        return
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
            dispatcher._maybe_dtoh_and_synchronize = _HostDtoH(dispatcher)


def in_process_save_results() -> None:
    """Before a synchronous ``dist_checkpointing.save``: give megatron's torch_dist writer a thread queue for its
    write results. megatron 0.16.1 creates that queue on a process's first save as
    ``multiprocessing.get_context("spawn").Manager().Queue()`` (``strategies/filesystem_async.py:51``), which spawns a
    manager server process that re-imports the caller's main module: 1.5 s of the first checkpoint of every worker on
    a 2-core CPU, and a process that outlives the save. In a synchronous save (``AsyncRequest.execute_sync``) the
    results are put and read in this process (the forked file writers report on a queue of their own), so a thread
    queue carries them. verl_lite saves synchronously only (``checkpoint.async_save`` is refused)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


_NO_STREAM = object()  # placeholder for megatron's class-level DtoH stream on a CPU-only torch


class _HostDtoH:
    """megatron's ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` for host tensors: at the
    dispatcher's DtoH point the split sizes are turned into numpy arrays (what ``all_to_all`` expects),
    without streams or events."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher

    def __call__(self, point: str, tokens_per_expert=None):
        d = self.dispatcher
        if not d.drop_and_pad and point == d.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(d, name, None)
                if torch.is_tensor(value):
                    setattr(d, name, value.numpy())
        return tokens_per_expert


@contextlib.contextmanager
def torch_adam_step_fix(optimizer):
    """megatron-core 0.16.1, distributed optimizer on torch's Adam (no Apex/TE): loading the
    ``fully_reshardable`` format copies every per-parameter state key from the checkpoint, but the
    checkpoint's per-parameter tensors exclude ``step`` (it travels in the param groups and is already
    restored), so ``_set_main_param_and_optimizer_states`` raises ``KeyError: 'step'``. While active,
    the missing ``step`` is filled with the value already restored (a copy onto itself)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer):
            continue
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state and "step" not in tensors:
                tensors = dict(tensors, step=state["step"])
            original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def unshare_adam_steps(optimizer) -> None:
    """megatron's load_state_dict gives every parameter the SAME ``step`` tensor; torch's Adam increments
    each parameter's step in place, so a shared one would advance once per parameter per optimizer step
    (wrong bias correction from the second step after a resume on). Give each parameter its own copy."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().clone()
