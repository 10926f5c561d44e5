"""Build the shipped distillation teacher: verl_lite/assets/tiny-addition-teacher (recipes/distill.yaml).

The shipped tiny policy (verl_lite/assets/tiny-addition) trained further with the default GRPO job on the synthetic
addition task for ``--epochs`` passes over its RL prompts (60 steps each), through the real CLI; the run's final
policy (its ``huggingface/`` export: weights, config, the policy's tokenizer) becomes the teacher, with the run's
held-out accuracy curve in ``teacher_summary.json``. Same architecture and tokenizer as the student; it only knows
more addition.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/make_distill_teacher.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "verl_lite" / "assets" / "tiny-addition-teacher"


def train(epochs: int, work: Path) -> Path:
    """Run the GRPO job for ``epochs`` passes; return its run directory."""
    cmd = [sys.executable, "-m", "verl_lite.trainer.main_ppo", "--recipe", "grpo", f"trainer.total_epochs={epochs}",
           "trainer.test_freq=20", f"trainer.output_dir={work}", f"trainer.default_local_dir={work / 'ckpt'}",
           "trainer.experiment_name=distill_teacher"]
    subprocess.run(cmd, cwd=ROOT, check=True)
    (run_dir,) = [p for p in work.iterdir() if p.name.startswith("distill_teacher")]
    return run_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="distill_teacher_") as tmp:
        run_dir = train(args.epochs, Path(tmp))
        summary = json.loads((run_dir / "summary.json").read_text())
        if OUT.exists():
            shutil.rmtree(OUT)
        shutil.copytree(run_dir / "huggingface", OUT)
        val = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        curve = [{"step": m["step"], "val_accuracy": m["val/accuracy"]} for m in val if "val/accuracy" in m]
    (OUT / "teacher_summary.json").write_text(json.dumps({
        "made_by": "scripts/make_distill_teacher.py", "start": "verl_lite/assets/tiny-addition",
        "recipe": "grpo", "epochs": args.epochs, "steps": summary["steps"],
        "initial_val_accuracy": summary["initial_val_accuracy"], "final_val_accuracy": summary["final_val_accuracy"],
        "val_curve": curve}, indent=1) + "\n")
    print(f"wrote {OUT}: held-out accuracy {summary['initial_val_accuracy']} -> {summary['final_val_accuracy']}")


if __name__ == "__main__":
    main()
