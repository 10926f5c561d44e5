"""The built-in synthetic task: multi-digit addition ("47+385=" -> "432"), in verl's parquet row format
(:func:`make_rows`).

The verifier (`score_addition`) is strict: 1.0 when the stripped response is the decimal sum and nothing else.
`extra_info["demonstration"]` is the response an SFT warm start imitates; in a fraction `restate_fraction` of the
rows it restates the problem ("47+385=432"), as real SFT data mixes answer styles, and the verifier scores that 0:
GRPO on its reward then fixes both the carries and the style.
"""

from __future__ import annotations

import random
from pathlib import Path

DATA_SOURCE = "synthetic/addition"


def addition_prompt(a: int, b: int) -> str:
    """The user message for a + b."""
    return f"{a}+{b}="


def score_addition(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response (decoded, special tokens removed, whitespace stripped) equals the sum, else 0.0."""
    return 1.0 if solution_str.strip() == str(ground_truth).strip() else 0.0


def _sample_pairs(n: int, max_digits: int, rng: random.Random, exclude: set) -> list[tuple[int, int]]:
    """n distinct (a, b) pairs not in `exclude`; each operand has a uniformly drawn digit count 1..max_digits."""
    available = (10**max_digits) ** 2 - len(exclude)
    if n > available:
        raise ValueError(f"asked for {n} distinct pairs but only {available} exist with max_digits={max_digits}")
    pairs, seen = [], set(exclude)
    while len(pairs) < n:
        da, db = rng.randint(1, max_digits), rng.randint(1, max_digits)
        a = rng.randint(0 if da == 1 else 10 ** (da - 1), 10**da - 1)
        b = rng.randint(0 if db == 1 else 10 ** (db - 1), 10**db - 1)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        pairs.append((a, b))
    return pairs


def demonstration(a: int, b: int, restate: bool) -> str:
    """The SFT target: the bare sum, or the restated equation."""
    return f"{addition_prompt(a, b)}{a + b}" if restate else str(a + b)


def make_rows(pairs: list[tuple[int, int]], split: str, restate: list[bool] | None = None) -> list[dict]:
    """verl rows for the given operand pairs (restate[i]: row i's demonstration restates the problem)."""
    restate = restate or [False] * len(pairs)
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": addition_prompt(a, b)}],
            "ability": "arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i, "a": a, "b": b, "demonstration": demonstration(a, b, r)},
        }
        for i, ((a, b), r) in enumerate(zip(pairs, restate))
    ]


def make_synthetic_task(
    out_dir: str | Path, n_train: int = 4096, n_val: int = 256, seed: int = 0, max_digits: int = 2,
    restate_fraction: float = 0.0,
) -> tuple[Path, Path]:
    """Write `train.parquet` and `val.parquet` (disjoint operand pairs) to out_dir and return both paths. The val
    pairs are drawn first, so the val set depends on (seed, n_val, max_digits) only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(seed)
    val_pairs = _sample_pairs(n_val, max_digits, rng, exclude=set())
    train_pairs = _sample_pairs(n_train, max_digits, rng, exclude=set(val_pairs))
    restate_rng = random.Random(seed + 1)
    restate = {split: [restate_rng.random() < restate_fraction for _ in pairs]
               for split, pairs in (("val", val_pairs), ("train", train_pairs))}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, pairs in (("train", train_pairs), ("val", val_pairs)):
        path = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(make_rows(pairs, split, restate[split])), path)
        paths.append(path)
    return paths[0], paths[1]
