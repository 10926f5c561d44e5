"""Derive the shipped RL train split from the SFT demonstrations (verl_lite/assets/synthetic-addition).

`train.parquet` holds the steps x batch rows that a run over `sft_train.parquet` would visit in its
first `steps` batches (epoch-0 shuffle, data.seed), stored in the order whose own epoch-0 shuffle
yields the same batches. So the default job (`trainer.total_training_steps: null`, one epoch) is
`steps` steps and sees exactly those batches.

    python scripts/make_rl_train_split.py            # 60 x 16 rows, seed 0
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "verl_lite/assets/synthetic-addition"


def rl_train_rows(num_rows: int, steps: int, batch_size: int, seed: int) -> list[int]:
    """Row indices of the full split, in file order, for the derived split."""
    from verl_lite.data.dataset import epoch_order

    n = steps * batch_size
    visited = epoch_order(num_rows, True, seed, 0)[:n]
    rows = [0] * n
    for i, j in enumerate(epoch_order(n, True, seed, 0)):
        rows[j] = visited[i]
    return rows


def main() -> None:
    import pyarrow.parquet as pq

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=str(DATA), help="holds sft_train.parquet; train.parquet is written there")
    args = ap.parse_args()
    data = Path(args.data_dir)
    full = pq.read_table(data / "sft_train.parquet")
    pq.write_table(full.take(rl_train_rows(full.num_rows, args.steps, args.batch_size, args.seed)),
                   data / "train.parquet")
    print(f"{data / 'train.parquet'}: {args.steps * args.batch_size} rows")


if __name__ == "__main__":
    main()
