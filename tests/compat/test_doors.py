"""The reaches into other libraries' internals that moved behind compat/'s named functions keep their contracts:

- ``ray_local.init_local_head``: ``ray.init`` of a loopback-bound local head with Ray's internal settings (a copy:
  Ray may keep or change the dict it is given);
- ``megatron_internals.main_param_shard_range``: the shard of a parameter's fp32 main copy from the distributed
  optimizer that manages it, a KeyError for a parameter none manages; ``use_swiglu_mlp`` refuses a class that is
  not megatron's MLP (re-classing to it would break the modules);
- ``torch_internals.torch_function_disabled``: no torch-function mode runs inside it, the mode is back after it;
- ``utils.quiet``: dropping the driver's filters (public ``warnings`` API only) keeps every other filter in its
  order, and a warning the filters hid shows once they are dropped.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from verl_lite.compat import megatron_internals, ray_local
from verl_lite.compat.torch_internals import torch_function_disabled
from verl_lite.utils import quiet


def test_init_local_head_binds_loopback_with_a_copy_of_rays_internal_settings(monkeypatch):
    calls = []
    monkeypatch.setattr(ray_local.ray, "init", lambda **kwargs: calls.append(kwargs))
    ray_local.init_local_head(num_cpus=2, include_dashboard=False)
    (kwargs,) = calls
    assert kwargs.pop("_system_config") == ray_local.LOCAL_SYSTEM_CONFIG
    assert kwargs == {"address": "local", "_node_ip_address": "127.0.0.1", "num_cpus": 2, "include_dashboard": False}
    calls.clear()
    ray_local.init_local_head()
    calls[0]["_system_config"]["worker_niceness"] = 19  # what Ray does with its dict stays there
    assert ray_local.LOCAL_SYSTEM_CONFIG["worker_niceness"] == 0


class _Range:
    def __init__(self, start: int, end: int):
        self.start, self.end = start, end


def test_main_param_shard_range_reads_the_optimizer_that_manages_the_parameter():
    dense, expert, stray = torch.zeros(4), torch.zeros(6), torch.zeros(2)
    asked = []

    def optimizer_of(param, start, end):
        def range_map(p):
            asked.append(p)
            return {"param": _Range(start, end)}

        return SimpleNamespace(model_param_gbuf_map={param: 0}, _get_model_param_range_map=range_map)

    chained = SimpleNamespace(chained_optimizers=[optimizer_of(dense, 0, 2), optimizer_of(expert, 3, 6)])
    assert megatron_internals.main_param_shard_range(chained, expert) == (3, 6)
    assert asked == [expert]  # only the optimizer that manages it was asked
    assert megatron_internals.main_param_shard_range(optimizer_of(dense, 1, 4), dense) == (1, 4)
    with pytest.raises(KeyError, match="not managed by the distributed optimizer"):
        megatron_internals.main_param_shard_range(chained, stray)


def test_use_swiglu_mlp_refuses_a_class_that_is_not_megatrons_mlp():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="Linear is not a subclass of megatron's MLP"):
        megatron_internals.use_swiglu_mlp(model, torch.nn.Linear)
    assert type(model[0]) is torch.nn.Linear


class _CountingMode(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_torch_function_disabled_skips_every_mode_inside_only():
    x = torch.ones(3)
    with _CountingMode() as mode:
        torch.add(x, 1)
        seen = mode.calls
        with torch_function_disabled():
            assert torch.equal(torch.add(x, 1), x + 1) and torch.equal(x * 2, torch.full((3,), 2.0))
        assert mode.calls == seen
        torch.add(x, 1)
        assert mode.calls == seen + 1


def test_dropping_the_drivers_filters_keeps_the_others_and_shows_hidden_warnings_again(monkeypatch):
    message, category = quiet.MEGATRON_WARNINGS[0]
    text = "Transformer Engine and Apex are not installed. Falling back"
    monkeypatch.setitem(quiet._state, "debug", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.filterwarnings("ignore", message="someone else's")
        warnings.simplefilter("default")
        theirs = list(warnings.filters)
        registry: dict = {}

        def warn() -> None:  # as from a megatron module, with the registry its warnings.warn call would keep
            warnings.warn_explicit(text, category, "megatron/core/optimizer/__init__.py", 24,
                                   module="megatron.core.optimizer", registry=registry)

        quiet.quiet_process(debug=False)
        assert len(warnings.filters) == len(theirs) + len(quiet.MEGATRON_WARNINGS)
        warn()
        assert caught == []
        quiet.quiet_process(debug=True)
        assert warnings.filters == theirs
        warn()
        warn()  # "default": once per location
        assert [str(w.message) for w in caught] == [text]
