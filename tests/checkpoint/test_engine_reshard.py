"""Engine resharding (4 processes, one launch): a checkpoint written at TP2xPP2 with the distributed
optimizer after one step loads at DP4, CP2xTP2 and PP2xVPP2: the weights read back are bit-identical
to the saved ones, and one more identical step from the loaded state (model + Adam moments + step
count + LR schedule) matches the saver's own next step within 1e-6 relative. The same holds for a LoRA
checkpoint (adapters on every linear, their Adam moments; the frozen base): its factors and base read
back bit-identical at each layout and the next step matches. Unsupported changes raise
CheckpointLayoutError naming the change."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import spawn_ranks, use_layout

SAVE = dict(tp=2, pp=2)
LOADS = [dict(), dict(tp=2, cp=2), dict(pp=2, vpp=2)]
REL_TOL = 1e-6


def _build(rank, world, par_kw, model, dist_opt=True, lr=1e-2, keep_schedule=False, lora=False):
    from verl_lite.engine.engine import MegatronEngine
    from verl_lite.engine.config import LoraConfig
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig

    par = MegatronConfig.layout(**par_kw, use_distributed_optimizer=dist_opt)
    use_layout(rank, world, par)
    adapters = LoraConfig(rank=4, alpha=8.0, target_modules=["all-linear"]) if lora else None
    return MegatronEngine(EngineConfig(model_path=model, megatron=par, lora=adapters, total_steps=10, optim=OptimConfig(
        lr=lr, lr_decay_style="linear", use_checkpoint_opt_param_scheduler=keep_schedule)))


def _step(engine):
    from verl_lite.engine.distributed import data_parallel_rank, data_parallel_size
    from verl_lite.engine.engine import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 100, (n,), generator=g) for n in (7, 9, 5, 8, 6, 10, 7, 9)]
    resp = torch.tensor([3, 4, 2, 3, 2, 4, 3, 3])
    dp, r = data_parallel_size(), data_parallel_rank()
    rows = [i for i in range(len(ids)) if i % dp == r]
    batch = SequenceBatch([ids[i] for i in rows], resp[rows], response_width=int(resp.max()))
    n = len(rows)
    micro = [list(range(0, n // 2)), list(range(n // 2, n))]

    def loss(out, data):
        return -out["log_probs"].sum() / 100.0, {}

    engine.advance_lr_schedule()  # a schedule step before each train step here (SFT's order)
    return engine.train_step(batch, micro, loss)


def _weights(engine):
    """The full HF-named weights, and with LoRA also the PEFT-named factors."""
    weights = {k: v.clone() for k, v in engine.export_hf()}
    if engine.cfg.lora is not None:
        weights.update({k: v.clone() for k, v in engine.export_adapter().items()})
    return weights


def _rel(a, b):
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    return (num / sum(float(a[k].double().pow(2).sum()) for k in a)) ** 0.5


def _worker(rank, world, model, other_model, directory):
    import psutil

    from verl_lite.engine.checkpoint import CheckpointLayoutError

    out = {"cases": [], "children_after_save": []}
    for lora in (False, True):
        where = f"{directory}/{'lora' if lora else 'full'}"
        e = _build(rank, world, SAVE, model, lora=lora)
        _step(e)
        e.save_checkpoint(where)
        out["children_after_save"] += [p.cmdline() for p in psutil.Process().children(recursive=True)]
        saved = _weights(e)
        lr_saved = e.scheduler.get_lr({})
        _step(e)
        after = _weights(e)
        for kw in LOADS:
            f = _build(rank, world, kw, model, lr=5.0, keep_schedule=True, lora=lora)  # the checkpoint's lr must win
            f.load_checkpoint(where)
            loaded = _weights(f)
            exact = loaded.keys() == saved.keys() and all(torch.equal(loaded[k], saved[k]) for k in saved)
            same_lr = f.scheduler.get_lr({}) == lr_saved
            _step(f)
            out["cases"].append({"layout": kw, "lora": lora, "exact": exact, "same_lr": same_lr,
                                 "rel": _rel(after, _weights(f)), "adapters": sum("lora_" in k for k in saved)})
    directory = f"{directory}/full"
    own = _build(rank, world, {}, model, lr=5.0)  # verl's default: the saved step count, this engine's schedule
    out["own_schedule"] = own.load_checkpoint(directory)["lr_schedule"]
    errors = {}
    g = _build(rank, world, {}, model, dist_opt=False)
    try:
        g.load_checkpoint(directory)
    except CheckpointLayoutError as err:
        errors["optimizer"] = str(err)
    h = _build(rank, world, {}, other_model)
    try:
        h.load_checkpoint(directory)
    except CheckpointLayoutError as err:
        errors["arch"] = str(err)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from verl_lite.utils import make_tiny_hf_model

    root = tmp_path_factory.mktemp("reshard")
    kw = dict(vocab_size=104, num_attention_heads=4, num_key_value_heads=2, seed=0)
    model = make_tiny_hf_model(root / "m", hidden_size=32, num_layers=4, intermediate_size=64, **kw)
    other = make_tiny_hf_model(root / "o", hidden_size=48, num_layers=4, intermediate_size=64, **kw)
    return spawn_ranks(_worker, 4, str(model), str(other), str(root / "ckpt"), timeout_s=300)[0]


CASES = [(lora, kw) for lora in (False, True) for kw in LOADS]


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{'lora-' if lora else ''}{kw}" for lora, kw in CASES])
def test_reshard_loads_exactly_and_continues(results, index):
    case = results["cases"][index]
    assert (case["lora"], case["layout"]) == CASES[index]
    assert case["adapters"] == (2 * 7 * 4 if case["lora"] else 0)  # A and B of 7 projections in 4 layers
    assert case["exact"], f"weights read back at {case['layout']} differ from the saved ones"
    assert case["same_lr"], "the LR schedule did not come from the checkpoint"
    assert case["rel"] <= REL_TOL, case


def test_a_save_leaves_no_process_behind(results):
    """The save's file writers are forked per save and joined; no helper process (megatron's spawned result-queue
    manager, before compat.megatron_internals.in_process_save_results) outlives it."""
    assert results["children_after_save"] == []


def test_by_default_the_loaded_step_count_continues_this_engines_schedule(results):
    s = results["own_schedule"]  # saved after 1 step of lr 1e-2 linear over 10; loaded with lr 5.0
    assert (s["step"], s["max_lr"], s["decay_steps"], s["source"]) == (1, 5.0, 10, "config")
    assert s["next_lr"] == pytest.approx(5.0 * (1 - 1 / 10), rel=1e-12)  # schedule step 1 of 10, no warm-up
    assert s["saved"]["max_lr"] == pytest.approx(1e-2)


def test_unsupported_changes_name_the_change(results):
    errors = results["errors"]
    assert "use_distributed_optimizer=True" in errors["optimizer"] and "not supported" in errors["optimizer"]
    assert "different model architecture" in errors["arch"] and "hidden_size" in errors["arch"]
