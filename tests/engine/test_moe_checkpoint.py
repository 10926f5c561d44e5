"""A MoE engine (EP2: each rank holds half the experts) saves its state and a fresh engine resumes it
bit-exactly: the loaded weights equal the saved ones and the next optimizer step (router losses on)
is identical to the one the original engine takes. At another EP size (one process, EP1) both a
trainable and a forward-only engine refuse the checkpoint with the reason: resharding over EP is not
supported (megatron keeps a separate expert optimizer only when EP > 1, and the weights of an EP
change were measured misplaced)."""

from __future__ import annotations

import dataclasses
import traceback
from pathlib import Path

import torch


TOKENS = 36  # 2 ranks x 2 sequences x 9 tokens: the mini-batch's token count N of the router losses


def _rank_sequences(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randint(1, 64, (9,), generator=g) for _ in range(2)]


def _loss_fn(outputs, data):
    """sum of w x log-prob over the micro-batch; w = 1/16 on each of 2 DP ranks (megatron averages
    the two) or 1/32 in one process: the same objective, sum over the mini-batch / 32."""
    return (outputs["log_probs"] * data["w"]).sum(), {}


def _engine_config(model_dir, par):
    from verl_lite.engine.config import EngineConfig, OptimConfig

    par = dataclasses.replace(par, override_transformer_config={"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001})
    return EngineConfig(model_path=model_dir, megatron=par, optim=OptimConfig(lr=1e-3))


def _worker(rank, world, port, model_dir, ckpt, out, layout=(("ep", 2),)):
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        from verl_lite.engine.distributed import destroy_distributed, init_distributed
        from verl_lite.engine.config import MegatronConfig
        from verl_lite.engine.engine import MegatronEngine, SequenceBatch

        from megatron.core import parallel_state as ps

        par = MegatronConfig.layout(timeout_s=120, **dict(layout))
        init_distributed(rank, world, "127.0.0.1", port, par)
        cfg = _engine_config(model_dir, par)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()  # TP2: one DP rank, all sequences
        sequences = [s for r in range(2) if r % dp == dp_rank for s in _rank_sequences(r)]
        batch = SequenceBatch(sequences, [4] * len(sequences), {"w": torch.full((len(sequences), 4), 1 / (32 // dp))})
        loss_fn = _loss_fn

        engine = MegatronEngine(cfg)
        micro = [list(range(len(sequences)))]
        engine.train_step(batch, micro, loss_fn, global_token_count=TOKENS)
        engine.save_checkpoint(ckpt)
        saved = dict(engine.export_hf("param"))
        engine.train_step(batch, micro, loss_fn, global_token_count=TOKENS)
        stepped = dict(engine.export_hf("param"))
        resumed = MegatronEngine(cfg)
        resumed.load_checkpoint(ckpt)
        loaded = dict(resumed.export_hf("param"))
        resumed.train_step(batch, micro, loss_fn, global_token_count=TOKENS)
        restepped = dict(resumed.export_hf("param"))
        if rank == 0:
            Path(out).write_text(repr((
                max(float((saved[k] - loaded[k]).abs().max()) for k in saved),
                max(float((stepped[k] - restepped[k]).abs().max()) for k in saved),
                max(float((stepped[k] - saved[k]).abs().max()) for k in saved),
            )))
        dist.barrier()
        destroy_distributed()
    except BaseException:
        Path(f"{out}.rank{rank}.err").write_text(traceback.format_exc())
        raise


def _ep1_worker(rank, world, port, model_dir, ckpt, out):
    """One process (EP1): a trainable and a forward-only engine must both refuse the EP2 checkpoint."""
    torch.set_num_threads(1)
    try:
        from dataclasses import replace

        from verl_lite.engine.checkpoint import CheckpointLayoutError
        from verl_lite.engine.distributed import destroy_distributed, init_distributed
        from verl_lite.engine.config import MegatronConfig
        from verl_lite.engine.engine import MegatronEngine

        par = MegatronConfig.layout(timeout_s=120)
        init_distributed(rank, world, "127.0.0.1", port, par)
        refusals = []
        for forward_only in (False, True):
            try:
                MegatronEngine(replace(_engine_config(model_dir, par), forward_only=forward_only)).load_checkpoint(ckpt)
                refusals.append("")
            except CheckpointLayoutError as err:
                refusals.append(str(err))
        Path(f"{out}.ep1").write_text(repr(refusals))
        destroy_distributed()
    except BaseException:
        Path(f"{out}.rank{rank}.err").write_text(traceback.format_exc())
        raise


def test_moe_checkpoint_at_tp2_resumes_exactly_and_refuses_tp1(tmp_path):
    """TP2 with sequence parallelism at EP1: the TP ranks route their own tokens, so the experts are reduced over the
    expert-data-parallel group in an optimizer of their own (compat.reduce_replicated_experts); the checkpoint resumes
    bit-exactly at TP2, and a trainable engine at TP1 (experts with the dense weights) refuses it with the reason."""
    from tests.fork_ranks import start_ranks

    from verl_lite.utils.net import free_port
    from verl_lite.utils.tiny_model import make_tiny_moe_model

    model = make_tiny_moe_model(tmp_path / "model", "qwen3_moe")
    out = tmp_path / "out.txt"
    layout = (("tp", 2), ("sequence_parallel", True))
    try:
        start_ranks(_worker, (2, free_port(), str(model), str(tmp_path / "ckpt"), str(out), layout), nprocs=2)
    except Exception as e:
        raise RuntimeError("\n".join(p.read_text()[-3000:] for p in tmp_path.glob("out.txt.rank*.err"))) from e
    load_diff, resume_diff, step_size = eval(out.read_text())
    assert step_size > 0 and load_diff == 0.0 and resume_diff == 0.0, (load_diff, resume_diff, step_size)
    try:
        start_ranks(_ep1_worker, (1, free_port(), str(model), str(tmp_path / "ckpt"), str(out)), nprocs=1)
    except Exception as e:
        raise RuntimeError("\n".join(p.read_text()[-3000:] for p in tmp_path.glob("out.txt.rank*.err"))) from e
    trainable, forward_only = eval(Path(f"{out}.ep1").read_text())
    assert "keeps the experts' optimizer state in an optimizer of their own (saved at tensor_model_parallel_size=2" \
        in trainable and "resume with the saved tensor_model_parallel_size=2" in trainable, trainable
    assert forward_only == "", forward_only  # weights alone load at TP1


def test_moe_checkpoint_resume_is_bit_exact(tmp_path):
    from tests.fork_ranks import start_ranks

    from verl_lite.utils.net import free_port
    from verl_lite.utils.tiny_model import make_tiny_moe_model

    model = make_tiny_moe_model(tmp_path / "model", "qwen3_moe")
    out = tmp_path / "out.txt"
    try:
        start_ranks(_worker, (2, free_port(), str(model), str(tmp_path / "ckpt"), str(out)), nprocs=2)
    except Exception as e:
        raise RuntimeError("\n".join(p.read_text()[-3000:] for p in tmp_path.glob("out.txt.rank*.err"))) from e
    load_diff, resume_diff, step_size = eval(out.read_text())
    assert step_size > 0, "the step changed nothing: the check needs an update"
    assert load_diff == 0.0 and resume_diff == 0.0, (load_diff, resume_diff)

    # the same checkpoint at EP1 in one process
    try:
        start_ranks(_ep1_worker, (1, free_port(), str(model), str(tmp_path / "ckpt"), str(out)), nprocs=1)
    except Exception as e:
        raise RuntimeError("\n".join(p.read_text()[-3000:] for p in tmp_path.glob("out.txt.rank*.err"))) from e
    for refusal in eval(Path(f"{out}.ep1").read_text()):
        assert "expert_model_parallel_size=2 and this engine has 1" in refusal and "resume with" in refusal, refusal
