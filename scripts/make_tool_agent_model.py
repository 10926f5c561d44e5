"""Build the shipped tool-agent model and data: verl_lite/assets/tool-agent + verl_lite/assets/tool-agent-data.

The task (``verl_lite/data/tool_task.py``): multiply a 2-4 digit number by a 2-3 digit one, with a
``calculator`` tool. Steps (all local, deterministic given --seed; CPU is enough):

1. verl parquet rows: ``sft_train.parquet`` (the demonstrations), ``train.parquet`` (the RL prompts),
   ``val.parquet`` (held out), with pairwise-disjoint operand pairs; ``tool_config.yaml`` (verl's
   tool-config shape) naming ``verl_lite.data.tool_task.Calculator``;
2. the character-level tokenizer (``verl_lite.data.char_tokenizer``) with ``TOOL_CHAT_TEMPLATE``, which
   renders the tool list, hermes tool calls and tool responses (the tiny-addition template is unchanged);
3. a randomly initialised Qwen2-architecture model (the tiny-addition shape, 256 positions);
4. SFT on the megatron engine (``verl_lite.trainer.sft``'s step and loss) on multi-turn demonstrations:
   ``<tool_call>{...}</tool_call><eos>`` + the tool response as the agent loop renders it + the answer
   ``<eos>``, the tool response's tokens masked out of the loss (as RL masks them). A demonstration
   calls the tool unless its row answers from memory (``--small-tool-fraction``: of the rows whose
   first factor has 2 digits only that share calls the tool; the others always do), so the warm start
   often answers 2-digit-first problems without the tool, and is wrong there: room for RL;
5. greedy held-out accuracy is measured through the real agent loop (``verl_lite.agent.AgentRunner``,
   the calculator running), and SFT stops at the first evaluation reaching --target-accuracy (a PARTIAL
   accuracy, so RL has room); the model, tokenizer and sft_summary.json go to the asset folder.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/make_tool_agent_model.py
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MAX_PROMPT_LENGTH = 48  # '<|system|>tools:calculator(expression);<|user|>3471*893=<|assistant|>' is 41
MAX_RESPONSE_LENGTH = 144  # call (83 with <eos>) + tool response glue (<= 40) + answer (<= 8): 131 at most


def tool_call_text(a: int, b: int) -> str:
    """The demonstrated model turn that calls the calculator (hermes format, compact JSON as the template renders it)."""
    from verl_lite.data.tool_task import TOOL_NAME

    call = {"name": TOOL_NAME, "arguments": {"expression": f"{a}*{b}"}}
    return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def _digits(rng: random.Random, lo: int, hi: int) -> int:
    d = rng.randint(lo, hi)
    return rng.randint(10 ** (d - 1), 10**d - 1)


def sample_pairs(n: int, rng: random.Random, exclude: set, a_digits=(2, 4), b_digits=(2, 3)) -> list[tuple[int, int]]:
    """n distinct (a, b) pairs not in ``exclude``; digit counts drawn uniformly in the given ranges."""
    pairs, seen = [], set(exclude)
    while len(pairs) < n:
        pair = (_digits(rng, *a_digits), _digits(rng, *b_digits))
        if pair not in seen:
            seen.add(pair)
            pairs.append(pair)
    return pairs


def make_rows(pairs: list[tuple[int, int]], split: str, uses_tool: list[bool]) -> list[dict]:
    """verl rows for the operand pairs (``uses_tool[i]``: row i's demonstration calls the calculator); the user
    message for a * b is ``a*b=``."""
    from verl_lite.data.tool_task import DATA_SOURCE

    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{a}*{b}="}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a * b)},
            "extra_info": {"split": split, "index": i, "a": a, "b": b, "uses_tool": bool(t)},
        }
        for i, ((a, b), t) in enumerate(zip(pairs, uses_tool))
    ]


def write_data(data_dir: Path, args) -> dict[str, Path]:
    """The three parquet splits (disjoint pairs; val drawn first) and the tool config YAML."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml

    from verl_lite.data.tool_task import TOOL_SCHEMA

    rng = random.Random(args.seed)
    taken: set = set()
    splits = {}
    for split, n in (("val", args.n_val), ("train", args.n_train), ("sft_train", args.n_sft)):
        pairs = sample_pairs(n, rng, taken)
        taken |= set(pairs)
        uses_tool = [len(str(a)) > 2 or rng.random() < args.small_tool_fraction for a, _ in pairs]
        splits[split] = make_rows(pairs, split, uses_tool)
    data_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        paths[split] = data_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    config = {"tools": [{"class_name": "verl_lite.data.tool_task.Calculator", "config": {"type": "native"},
                         "tool_schema": TOOL_SCHEMA}]}
    paths["tool_config"] = data_dir / "tool_config.yaml"
    paths["tool_config"].write_text(
        "# verl's tool-config shape (actor_rollout_ref.rollout.multi_turn.tool_config_path); "
        "built by scripts/make_tool_agent_model.py\n" + yaml.safe_dump(config, sort_keys=False))
    return paths


def init_model(out: Path, args) -> Path:
    """A Qwen2-architecture model with transformers' standard initialisation, plus the tool tokenizer."""
    import torch
    import transformers

    from verl_lite.data.char_tokenizer import BOS_ID, EOS_ID, PAD_ID, TOOL_CHAT_TEMPLATE, build_char_tokenizer

    cfg = transformers.Qwen2Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size, max_position_embeddings=256, tie_word_embeddings=False,
        rope_theta=10000.0, rms_norm_eps=1e-6, use_sliding_window=False, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, pad_token_id=PAD_ID, initializer_range=0.02,
    )
    torch.manual_seed(args.seed)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    tok = build_char_tokenizer()
    tok.chat_template = TOOL_CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out


def multi_turn_settings(tool_config: Path) -> dict:
    """The agent loop's multi_turn values: the schema's defaults with the recipe's tool config and turn limit."""
    from verl_lite.agent.config import MultiTurnConfig

    return dict(asdict(MultiTurnConfig()), enable=True, tool_config_path=str(tool_config), max_assistant_turns=3)


def demonstration(item: dict, tok, glue) -> tuple[list[int], list[int]]:
    """(response ids, loss mask) of a row's demonstration: the tool call, the tool's answer (mask 0) and the
    final answer, each model turn ending in <eos>; or the bare answer when the row answers from memory."""
    a, b = item["extra_info"]["a"], item["extra_info"]["b"]
    answer = tok.encode(str(a * b), add_special_tokens=False) + [tok.eos_token_id]
    if not item["extra_info"]["uses_tool"]:
        return answer, [1] * len(answer)
    call = tok.encode(tool_call_text(a, b), add_special_tokens=False) + [tok.eos_token_id]
    env = glue.ids([{"role": "tool", "content": str(a * b)}])
    return call + env + answer, [1] * len(call) + [0] * len(env) + [1] * len(answer)


def masked_sft_step(engine, examples, masks, micro_batch_size: int) -> dict:
    """sft.sft_step with a loss mask that has holes (the tool responses): token-mean NLL over model tokens."""
    import torch

    from verl_lite.algorithms import NormalizationPlan
    from verl_lite.trainer.sft import make_sequence_batch, nll_loss_fn

    batch = make_sequence_batch(examples)
    for i, m in enumerate(masks):
        batch.data["response_mask"][i, : len(m)] = torch.tensor(m, dtype=batch.data["response_mask"].dtype)
    plan = NormalizationPlan.from_mask(batch.data["response_mask"], "token-mean")
    idx = list(range(len(examples)))
    micro = [idx[i:i + micro_batch_size] for i in range(0, len(idx), micro_batch_size)]
    return engine.train_step(batch, micro, nll_loss_fn(plan), outputs=("log_probs",))


def agent_accuracy(runner, tok, items: list[dict], batch_size: int = 256) -> tuple[float, float]:
    """(greedy held-out accuracy, tool-call rate) through the agent loop, the calculator answering."""
    from verl_lite.agent.loop import agent_rows
    from verl_lite.data.tool_task import compute_score

    correct = calls = 0
    for s in range(0, len(items), batch_size):
        chunk = items[s:s + batch_size]
        outs = runner.run(agent_rows(chunk), None, {"n": 1, "do_sample": False})
        for it, o in zip(chunk, outs):
            text = tok.decode(o["response_ids"], skip_special_tokens=True)
            correct += compute_score(it["data_source"], text, it["ground_truth"])
            calls += o["agent_stats"]["tool_calls"] > 0
    return correct / len(items), calls / len(items)


def run_tool_sft(init: Path, out: Path, paths: dict, args) -> dict:
    """SFT from ``init`` until the greedy held-out accuracy first reaches args.target_accuracy; writes ``out``."""
    from transformers import AutoTokenizer

    from verl_lite.agent.loop import AgentRunner, AgentSpec
    from verl_lite.data import RLDataset, iterate_batches
    from verl_lite.data.tool_task import TOOL_SCHEMA
    from verl_lite.engine import MegatronEngine, init_distributed
    from verl_lite.engine.distributed import destroy_distributed
    from verl_lite.rollout import HFRollout
    from verl_lite.utils.net import free_port
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig

    tok = AutoTokenizer.from_pretrained(init)
    sft = RLDataset([str(paths["sft_train"])], tok, MAX_PROMPT_LENGTH, tools=[TOOL_SCHEMA], verbose=False)
    val = RLDataset([str(paths["val"])], tok, MAX_PROMPT_LENGTH, tools=[TOOL_SCHEMA], verbose=False)
    val_items = [val[i] for i in range(len(val))]
    rollout = HFRollout(str(init), tok)
    spec = AgentSpec(multi_turn=multi_turn_settings(paths["tool_config"]), default_agent_loop="tool_agent",
                     max_response_length=MAX_RESPONSE_LENGTH, tool_schemas=[TOOL_SCHEMA])
    runner = AgentRunner(rollout, tok, spec)
    demos = [demonstration(sft[i], tok, runner.glue) for i in range(len(sft))]
    examples = [(sft[i]["prompt_ids"], r) for i, (r, _) in enumerate(demos)]
    masks = [m for _, m in demos]

    init_distributed(0, 1, "127.0.0.1", free_port(), MegatronConfig.layout(), seed=args.seed)
    try:
        optim = OptimConfig(lr=args.sft_lr, weight_decay=0.0, betas=[0.9, 0.99], lr_warmup_steps=0,
                            lr_decay_style="constant", min_lr=0.0)
        engine = MegatronEngine(EngineConfig(model_path=str(init), optim=optim, total_steps=args.sft_steps, seed=args.seed))
        history, t0, step, epoch, done = [], time.time(), 0, 0, False
        while not done:
            for idx in iterate_batches(list(range(len(examples))), args.sft_batch_size, shuffle=True,
                                       seed=args.seed, epoch=epoch):
                step += 1
                m = masked_sft_step(engine, [examples[j] for j in idx], [masks[j] for j in idx], args.sft_batch_size)
                done = step >= args.sft_steps
                if step % args.eval_every == 0 or done:
                    rollout.load_weights(engine.export_hf())
                    acc, rate = agent_accuracy(runner, tok, val_items)
                    history.append({"step": step, "nll": m.get("nll"), "grad_norm": m["grad_norm"],
                                    "time_s": round(time.time() - t0, 1), "val_accuracy": acc, "val_tool_call_rate": rate})
                    print(f"[sft] step {step} nll {m.get('nll'):.4f} val_acc {acc:.3f} tool_call_rate {rate:.3f} "
                          f"t {history[-1]['time_s']}s", flush=True)
                    done = done or acc >= args.target_accuracy
                if done:
                    break
            epoch += 1
        rollout.load_weights(engine.export_hf(), strict=True)
        if out.exists():
            shutil.rmtree(out)
        rollout.model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        return {"steps": step, "final_val_accuracy": history[-1]["val_accuracy"],
                "final_val_tool_call_rate": history[-1]["val_tool_call_rate"], "history": history}
    finally:
        destroy_distributed()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(ROOT / "verl_lite/assets/tool-agent"))
    ap.add_argument("--data-dir", default=str(ROOT / "verl_lite/assets/tool-agent-data"))
    ap.add_argument("--n-sft", type=int, default=8000)
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-val", type=int, default=256)
    ap.add_argument("--small-tool-fraction", type=float, default=0.25,
                    help="share of demonstrations with a 2-digit first factor that call the tool (the rest answer "
                         "from memory; every other demonstration calls the tool)")
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--intermediate-size", type=int, default=384)
    ap.add_argument("--vocab-size", type=int, default=128)
    ap.add_argument("--sft-steps", type=int, default=2000, help="upper bound; stops earlier at --target-accuracy")
    ap.add_argument("--sft-lr", type=float, default=1e-3)
    ap.add_argument("--sft-batch-size", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--target-accuracy", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    t0 = time.time()
    paths = write_data(Path(args.data_dir), args)
    print("data:", {k: str(v) for k, v in paths.items()})
    out = Path(args.model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        summary = run_tool_sft(init_model(Path(tmp) / "init", args), out, paths, args)
    summary["script_args"] = vars(args)
    summary["wall_time_s"] = round(time.time() - t0, 1)
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.2f} MB): SFT steps {summary['steps']}, held-out greedy accuracy "
          f"{summary['final_val_accuracy']:.3f}, tool-call rate {summary['final_val_tool_call_rate']:.3f}, "
          f"{summary['wall_time_s']} s")


if __name__ == "__main__":
    main()
