"""The default job side by side: verl_lite synchronous (colocated), verl_lite one-step-off (``--recipe
one_step_off``: a rollout pool of its own, staleness 1), verl_lite streamed on the actor's own workers
(``trainer.v1.trainer_mode=colocate_async``, one batch ahead), verl_lite streamed asynchronous (``--recipe async``:
``separate_async`` two batches ahead, the ratio to the sampler clipped) and TRL's GRPOTrainer (``--sides``
picks; sync always runs).

Install TRL once, in a venv of its OWN (as ``bench/rl_step_vs_trl.py`` says):

    python3 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install -r bench/requirements-trl.txt

Run with the project's interpreter:

    .venv/bin/python bench/async_vs_sync.py [--pairs 2] [--sides sync,one_step_off,async,colocate_async,trl] [--trl-python ...]

The same work on every side: the shipped tiny model, the synthetic-addition train split, 60 RL steps of
16 prompts x 8 samples, up to 12 new tokens, temperature 1, lr 1e-4 constant, AdamW (0.9, 0.99), no
weight decay, grad clip 1, GRPO advantages, token-mean loss, no KL, one optimizer step per RL step,
fp32, the same reward (exact match of the stripped response). In-run validation is off on both trainers (equal
work); each side writes its final model.

Each side is one whole process (``python -m verl_lite.trainer.main_ppo ...`` / a TRL script), timed
from the moment it is started until it has exited: interpreter start-up, imports, Ray, the workers,
60 steps, the final save and shut-down all count. Rounds alternate the order of the three sides.

Held-out accuracy is measured by one evaluator that imports neither trainer (transformers, pyarrow
and this file only): greedy decoding of every ``val.parquet`` prompt with the model's chat template,
the answer is the first integer in the completion, correct when it equals the row's ground truth.
Printed per side: steps per minute (60 / whole-process minutes), held-out accuracy before and after,
and held-out points per wall-clock minute, with the ratios one-step-off / sync and each / TRL.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "verl_lite" / "assets" / "tiny-addition"
DATA_DIR = REPO / "verl_lite" / "assets" / "synthetic-addition"
STEPS, PROMPTS, SAMPLES, NEW_TOKENS, LR = 60, 16, 8, 12, 1e-4
SIDES = ("sync", "one_step_off", "async", "colocate_async", "trl")
SIDE_ARGS = {"sync": [], "one_step_off": ["--recipe", "one_step_off"], "async": ["--recipe", "async"],
             "colocate_async": ["trainer.v1.trainer_mode=colocate_async"]}  # the key alone, as a verl script sets it


# ====================================================================== the sides
def verl_command(side: str, out: Path) -> list[str]:
    """The user's command line for a verl_lite side (the default job; validation off; the last step saved)."""
    return [sys.executable, "-m", "verl_lite.trainer.main_ppo", *SIDE_ARGS[side],
            f"trainer.total_training_steps={STEPS}", "trainer.test_freq=0", "trainer.val_before_train=false",
            f"trainer.save_freq={STEPS}", f"trainer.default_local_dir={out / 'ckpt'}",
            f"trainer.output_dir={out / 'run'}"]


def verl_model_dir(out: Path) -> Path:
    return out / "ckpt" / f"global_step_{STEPS}" / "huggingface"


def train_trl(out: Path) -> None:
    """TRL's GRPOTrainer on the default job's work (runs inside the TRL venv)."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    data = datasets.Dataset.from_parquet(str(DATA_DIR / "train.parquet"))
    data = data.map(lambda row: {"ground_truth": row["reward_model"]["ground_truth"]},
                    remove_columns=[c for c in data.column_names if c != "prompt"])

    def exact_match(completions, ground_truth, **_):
        """The default job's reward for this task, written out here: 1 when the completion (special tokens removed)
        stripped of whitespace equals the sum, else 0 (until 2026-12-05 this side scored the first integer, as the
        evaluator does: a more lenient reward than verl_lite's side was given)."""
        return [float(c[0]["content"].strip() == str(gt).strip()) for c, gt in zip(completions, ground_truth)]

    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=False, fp16=False, seed=0, report_to="none",
        save_strategy="no", logging_steps=10, disable_tqdm=True, dataloader_num_workers=0,
        per_device_train_batch_size=PROMPTS * SAMPLES, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=SAMPLES, num_iterations=1, max_completion_length=NEW_TOKENS, temperature=1.0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, beta=0.0, loss_type="dapo",
        scale_rewards="group", max_steps=STEPS,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=data,
                          processing_class=tokenizer)
    trainer.train()
    trainer.save_model(str(out / "trl_model"))
    tokenizer.save_pretrained(str(out / "trl_model"))


# ====================================================================== the evaluator
def first_integer(text: str) -> int | None:
    found = re.search(r"-?\d+", text)
    return int(found.group()) if found else None


def held_out_accuracy(model_dir: Path) -> float:
    """Greedy accuracy on val.parquet; imports neither trainer."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = pq.read_table(DATA_DIR / "val.parquet").to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)  # the policy's tokenizer and template on every side
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    correct = 0
    for start in range(0, len(rows), 64):
        batch = rows[start:start + 64]
        prompts = [tokenizer.apply_chat_template([dict(m) for m in r["prompt"]], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False) for r in batch]
        for prompt, row in zip(prompts, batch):  # one at a time: no padding to reason about
            with torch.no_grad():
                ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            text = tokenizer.decode(ids[0, len(prompt):], skip_special_tokens=True)
            correct += first_integer(text) == int(row["reward_model"]["ground_truth"])
    return correct / len(rows)


# ====================================================================== driver
def run_side(side: str, trl_python: str, out: Path, threads: int) -> tuple[float, Path]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    cmd = ([trl_python, str(Path(__file__).resolve()), "--train-trl", str(out)] if side == "trl"
           else verl_command(side, out))
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(REPO))
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"the {side} side failed (exit {proc.returncode}):\n{tail}")
    return wall, (out / "trl_model" if side == "trl" else verl_model_dir(out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-trl", help=argparse.SUPPRESS)
    p.add_argument("--pairs", type=int, default=2, help="rounds of the three sides, the order rotating")
    p.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON", "/tmp/trl-venv/bin/python"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sides", default="sync,one_step_off,trl", help=f"which of {', '.join(SIDES)} (sync always runs)")
    a = p.parse_args()
    if a.train_trl:
        return train_trl(Path(a.train_trl))
    sides = ["sync"] + [s for s in SIDES if s != "sync" and s in a.sides.split(",")]
    if "trl" in sides and not Path(a.trl_python).exists():
        sys.exit(f"no TRL interpreter at {a.trl_python}: install it as the module docstring says, or pass --trl-python")

    root = Path(tempfile.mkdtemp(prefix="async-vs-sync-"))
    runs: dict[str, list[tuple[float, Path]]] = {s: [] for s in sides}
    for pair in range(a.pairs):
        order = sides[pair % len(sides):] + sides[:pair % len(sides)]
        for side in order:
            runs[side].append(run_side(side, a.trl_python, root / f"{side}-{pair}", a.threads))
            print(f"round {pair + 1}/{a.pairs} {side}: {runs[side][-1][0]:.1f} s "
                  f"(load average {os.getloadavg()[0]:.2f})", flush=True)
    base = held_out_accuracy(MODEL_DIR)
    accuracy = {s: [held_out_accuracy(d) for _, d in runs[s]] for s in sides}

    name = {"sync": "verl_lite sync", "one_step_off": "verl_lite one-step-off", "async": "verl_lite --recipe async",
            "colocate_async": "verl_lite colocate_async", "trl": "TRL GRPOTrainer"}
    summary = {}
    print(f"\nheld-out accuracy of the shipped model: {base:.3f} (one evaluator, greedy, {STEPS} steps per run)")
    for side in sides:
        walls = [w for w, _ in runs[side]]
        points_per_min = [100 * (acc - base) / (w / 60) for (w, _), acc in zip(runs[side], accuracy[side])]
        summary[side] = {"steps_per_min": statistics.median(STEPS / (w / 60) for w in walls),
                         "points_per_min": statistics.median(points_per_min)}
        print(f"{name[side]:>23}: whole process {statistics.median(walls):.1f} s (runs: "
              f"{', '.join(f'{w:.1f}' for w in walls)}), {summary[side]['steps_per_min']:.0f} steps/min, held-out "
              f"{', '.join(f'{x:.3f}' for x in accuracy[side])}, {summary[side]['points_per_min']:.1f} points/min")
    print()
    for ref in ("sync", "trl"):
        for side in (x for x in sides if x != ref and x != "trl" and ref in summary):
            x, r = summary[side], summary[ref]
            print(f"{name[side]} / {name[ref]}: steps per minute {x['steps_per_min'] / r['steps_per_min']:.2f}x, "
                  f"points per minute {x['points_per_min'] / r['points_per_min']:.2f}x")


if __name__ == "__main__":
    main()
