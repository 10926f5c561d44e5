"""The megatron engine (knows no RL): packing, parallel layouts, infer / train_step, HF bridge.

megatron-core is imported lazily (on ``init_distributed`` / engine construction), so importing
this package stays cheap and installs nothing.
"""

from verl_lite.engine.config import EngineConfig, LoraConfig, MegatronConfig, OptimConfig
from verl_lite.engine.distributed import destroy_distributed, init_distributed
from verl_lite.engine.engine import MegatronEngine, SequenceBatch

__all__ = ["EngineConfig", "LoraConfig", "MegatronConfig", "MegatronEngine", "OptimConfig", "SequenceBatch",
           "destroy_distributed", "init_distributed"]
