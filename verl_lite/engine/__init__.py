"""The megatron engine (knows no RL): packing, parallel layouts, infer / train_step, HF bridge.

    from verl_lite.engine import ParallelConfig, init_distributed, EngineConfig, OptimConfig, \
        MegatronEngine, SequenceBatch

megatron-core is imported lazily (on ``init_distributed`` / engine construction), so importing
this package stays cheap and installs nothing.
"""

from verl_lite.engine.config import EngineConfig, OptimConfig
from verl_lite.engine.distributed import ParallelConfig, destroy_distributed, init_distributed
from verl_lite.engine.engine import MegatronEngine, SequenceBatch

__all__ = [
    "EngineConfig",
    "MegatronEngine",
    "OptimConfig",
    "ParallelConfig",
    "SequenceBatch",
    "destroy_distributed",
    "init_distributed",
]
