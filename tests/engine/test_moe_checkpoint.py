"""A MoE engine (EP2: each rank holds half the experts) saves its state and a fresh engine resumes it
bit-exactly: the loaded weights equal the saved ones and the next optimizer step (router losses on)
is identical to the one the original engine takes."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch


def _worker(rank, world, port, model_dir, ckpt, out):
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist

        from verl_lite.engine.config import EngineConfig, OptimConfig
        from verl_lite.engine.distributed import ParallelConfig, destroy_distributed, init_distributed
        from verl_lite.engine.engine import MegatronEngine, SequenceBatch

        par = ParallelConfig(ep=2, timeout_s=120)
        init_distributed(rank, world, "127.0.0.1", port, par)
        cfg = EngineConfig(model_path=model_dir, parallel=par, optim=OptimConfig(lr=1e-3),
                           model_overrides={"moe_aux_loss_coeff": 0.01, "moe_z_loss_coeff": 0.001})
        g = torch.Generator().manual_seed(rank)
        batch = SequenceBatch([torch.randint(1, 64, (9,), generator=g) for _ in range(2)], [4, 4],
                              {"w": torch.ones(2, 4)})

        def loss_fn(outputs, data):
            return (outputs["log_probs"] * data["w"]).sum() / 16, {}

        engine = MegatronEngine(cfg)
        engine.train_step(batch, [[0, 1]], loss_fn, global_token_count=36)
        engine.save_checkpoint(ckpt)
        saved = dict(engine.export_hf("param"))
        engine.train_step(batch, [[0, 1]], loss_fn, global_token_count=36)
        stepped = dict(engine.export_hf("param"))
        resumed = MegatronEngine(cfg)
        resumed.load_checkpoint(ckpt)
        loaded = dict(resumed.export_hf("param"))
        resumed.train_step(batch, [[0, 1]], loss_fn, global_token_count=36)
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


def test_moe_checkpoint_resume_is_bit_exact(tmp_path):
    import torch.multiprocessing as mp

    from verl_lite.utils.net import free_port
    from verl_lite.utils.tiny_model import make_tiny_moe_model

    model = make_tiny_moe_model(tmp_path / "model", "qwen3_moe")
    out = tmp_path / "out.txt"
    try:
        mp.spawn(_worker, args=(2, free_port(), str(model), str(tmp_path / "ckpt"), str(out)), nprocs=2)
    except Exception as e:
        raise RuntimeError("\n".join(p.read_text()[-3000:] for p in tmp_path.glob("out.txt.rank*.err"))) from e
    load_diff, resume_diff, step_size = eval(out.read_text())
    assert step_size > 0, "the step changed nothing: the check needs an update"
    assert load_diff == 0.0 and resume_diff == 0.0, (load_diff, resume_diff)
