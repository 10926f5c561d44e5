"""Probe (run as a script by test_recompute.py): 2 train steps with and without megatron activation recompute.

On CPU, megatron's CUDA RNG state save/restore is stubbed (the models have no dropout, so no RNG is
used); everything else is the real engine path."""
import torch, json, sys
torch.set_num_threads(1)
import megatron.core.tensor_parallel.random as mr
mr._get_cuda_rng_state = lambda *a, **k: torch.zeros(1)
mr._set_cuda_rng_state = lambda *a, **k: None
from verl_lite.engine import MegatronEngine, SequenceBatch
from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig
from verl_lite.engine.distributed import init_distributed
from verl_lite.utils.net import free_port
from verl_lite.utils.tiny_model import make_tiny_hf_model
from verl_lite.engine.config import RECOMPUTE
md = str(make_tiny_hf_model(sys.argv[1], "qwen2", vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, seed=0))
par = MegatronConfig.layout(timeout_s=60)
init_distributed(0, 1, "127.0.0.1", free_port(), par)
def loss(o, d):
    m = d["response_mask"]; return -(o["log_probs"] * m).sum() / 10.0, {"n": m.sum()}
g = torch.Generator().manual_seed(0)
ids = [torch.randint(1, 64, (n,), generator=g) for n in (7, 9, 5, 6)]
batch = SequenceBatch(ids, torch.tensor([3, 4, 2, 1]), {"response_mask": torch.ones(4, 4)})
out = {}
for name, ov in [("plain", {}), ("recompute", RECOMPUTE)]:
    e = MegatronEngine(EngineConfig(md, MegatronConfig.layout(timeout_s=60, override_transformer_config=ov),
                                    OptimConfig(lr=1e-3)))
    calls = []
    orig = mr.CheckpointFunction.forward
    def spy(ctx, *a, **k):
        calls.append(1); return orig(ctx, *a, **k)
    mr.CheckpointFunction.forward = staticmethod(spy)
    r = [e.train_step(batch, [[0, 1], [2, 3]], loss) for _ in range(2)]
    mr.CheckpointFunction.forward = orig
    out[name] = {"steps": r, "checkpoint_calls": len(calls)}
print(json.dumps(out, default=float))
