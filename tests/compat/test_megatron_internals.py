"""``compat.megatron_internals.use_fused_adam``: megatron's torch AdamW switched to torch's fused kernel.

The switch must reach every torch Adam inside megatron's wrappers (a plain optimizer's ``.optimizer``,
a ``ChainedOptimizer``'s ``chained_optimizers``), leave other optimizers alone, and give the update
torch's per-parameter loop gives, to float32 rounding, over several steps (bias correction included).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from verl_lite.compat.megatron_internals import use_fused_adam


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((64, 32), (32,), (7, 5, 3))]


def _run(params, optimizer, steps: int = 5):
    g = torch.Generator().manual_seed(10)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    return [p.detach().clone() for p in params]


def test_fused_adam_matches_the_loop_and_reaches_every_wrapped_optimizer():
    settings = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    loop_params, fused_params = _params(0), _params(0)
    loop = torch.optim.AdamW(loop_params, **settings)
    fused = torch.optim.AdamW([{"params": fused_params[:2]}, {"params": fused_params[2:]}], **settings)
    sgd = torch.optim.SGD(_params(1), lr=0.1)
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=fused), SimpleNamespace(optimizer=sgd)])

    use_fused_adam(chained)

    assert all(group["fused"] and not group["foreach"] for group in fused.param_groups)
    assert not sgd.param_groups[0].get("fused")
    assert not loop.param_groups[0]["fused"]
    for got, want in zip(_run(fused_params, fused), _run(loop_params, loop)):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert all(fused.state[p]["step"].item() == 5 for p in fused_params)


def test_use_fused_adam_again_after_steps_is_harmless():
    params = _params(2)
    opt = torch.optim.AdamW(params, lr=1e-3)
    wrapper = SimpleNamespace(optimizer=opt)
    use_fused_adam(wrapper)
    _run(params, opt, steps=2)
    use_fused_adam(wrapper)  # as after a checkpoint load
    _run(params, opt, steps=1)
    assert all(opt.state[p]["step"].item() == 3 for p in params)
