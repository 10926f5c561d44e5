"""verl_lite.compat.lazy_compile: tensordict and megatron import without torch._dynamo / wandb, and
nothing changes for code that does compile or use wandb afterwards (fresh interpreter per check)."""

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import sys, torch
    real_compile = torch.compile
    from verl_lite.compat.lazy_compile import compile_decorators_deferred

    with compile_decorators_deferred():
        import tensordict  # noqa: F401
        import megatron.core  # noqa: F401
        import megatron.core.timers as timers

        def double(x):
            return x * 2

        deferred = torch.compile(double, backend="eager")  # eager: no C++ build in the test
        marked = torch.compiler.assume_constant_result(lambda: 3)
    assert "torch._dynamo" not in sys.modules and "torch._inductor" not in sys.modules, "dynamo was imported"
    assert timers.wandb is None, "megatron must have taken wandb as absent"
    assert torch.compile is real_compile, "torch.compile not restored"
    assert marked._dynamo_marked_constant is True
    assert deferred.__wrapped__ is double and "torch._dynamo" not in sys.modules, "compiled before the first call"
    x = torch.arange(4.0)
    assert torch.equal(deferred(x), x * 2)  # the first call compiles with the real torch.compile
    assert "torch._dynamo" in sys.modules, "the first call must go through the real torch.compile"
    import wandb
    assert callable(wandb.init), "wandb must import normally after the block"
    print("OK")
""")


def test_imports_skip_dynamo_and_wandb_and_compile_on_first_call():
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", CHECK], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-4000:]
