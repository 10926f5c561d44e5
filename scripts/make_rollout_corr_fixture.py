"""Golden values of verl's own rollout correction, for tests/async_rl/test_rollout_correction_vocab.py.

Runs in a separate venv with verl itself (not verl_lite), made once:

    python3 -m venv /tmp/verlvenv
    /tmp/verlvenv/bin/pip install torch==2.13.0
    /tmp/verlvenv/bin/pip install --no-deps verl==0.9.1      # the newest verl on PyPI (no 0.10 release exists)
    /tmp/verlvenv/bin/pip install tensordict transformers omegaconf numpy packaging ray codetiming orjson
    /tmp/verlvenv/bin/python scripts/make_rollout_corr_fixture.py

(the extra packages are only what ``verl.trainer.ppo.rollout_corr_helper``'s imports need). It draws fixed
inputs (old / rollout log-probs in float64, masks with holes and an empty row, one case with log-ratios beyond
the +-20 safety bound), calls verl's ``compute_rollout_correction_and_rejection_mask`` for every option
(rollout_is level x TIS / IcePop threshold x batch normalization; every rollout_rs option with float and
``lower_upper`` thresholds; comma lists; IS + RS together; every preset factory of verl's
``RolloutCorrectionConfig``) and writes the inputs, the settings and verl's IS weights, modified response mask
and metrics to tests/async_rl/fixtures/rollout_corr_golden.json (plain JSON, floats written exactly). A case on
which verl itself raises (IcePop zeroing every weight: its effective sample size divides by zero) is recorded
with the error instead.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import torch
import verl
from verl.trainer.config.algorithm import RolloutCorrectionConfig
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests/async_rl/fixtures/rollout_corr_golden.json"
SETTING_KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")


def inputs(seed: int) -> dict[str, torch.Tensor]:
    """[6, 10] float64 log-probs; the mask has holes (inside responses) and one empty row; seed 2 has
    log-ratios beyond +-20."""
    g = torch.Generator().manual_seed(seed)
    n, w = 6, 10
    old = -torch.rand(n, w, generator=g, dtype=torch.float64) * 3
    scale = [0.6, 0.15, 1.5][seed]
    rollout = old + torch.randn(n, w, generator=g, dtype=torch.float64) * scale
    mask = (torch.rand(n, w, generator=g) > 0.25).to(torch.float64)
    mask[:, 0] = 1.0
    mask[1, 6:] = 0.0  # a shorter response
    mask[3] = 0.0  # a row without a valid token
    if seed == 2:
        rollout[0, 1] = old[0, 1] + 25.0  # beyond the safety bound, both directions
        rollout[4, 2] = old[4, 2] - 23.0
    return {"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask}


def settings() -> list[tuple[str, dict]]:
    """(name, settings) of every case."""
    off = {"rollout_is": None, "rollout_is_threshold": 2.0, "rollout_is_batch_normalize": False,
           "rollout_rs": None, "rollout_rs_threshold": None}
    out = [("metrics_only", dict(off))]
    for level in ("token", "sequence"):
        for threshold in (2.0, 1.2, "3.0", "0.5_5.0", "0.8_1.25"):
            for norm in (False, True):
                out.append((f"is_{level}_{threshold}_norm{int(norm)}",
                            {**off, "rollout_is": level, "rollout_is_threshold": threshold,
                             "rollout_is_batch_normalize": norm}))
    thresholds = {"k1": (2.0, "0.6_1.6", "0.999_1.001", "0.9_3.0"), "k2": (0.05, "0.5"), "k3": (0.02, 0.3)}
    for option in ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
                   "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"):
        for threshold in thresholds[option[-2:]]:
            out.append((f"rs_{option}_{threshold}", {**off, "rollout_rs": option, "rollout_rs_threshold": threshold}))
    for rs, threshold in (("token_k1,seq_max_k2", "0.6_1.6,2.5"), ("token_k1,seq_mean_k3", "0.5_2.0,0.1"),
                          ("seq_sum_k1,seq_mean_k1,token_k3", "0.3_3.0,0.9_1.1,0.2"), ("token_k2,seq_max_k3", 0.4),
                          ("token_k1, token_k1 ,seq_mean_k2", "1.5")):
        out.append((f"rs_list_{rs}_{threshold}", {**off, "rollout_rs": rs, "rollout_rs_threshold": threshold}))
    for level in ("token", "sequence"):
        out.append((f"is_{level}_rs_seq_mean_k3", {**off, "rollout_is": level, "rollout_is_threshold": 2.0,
                                                   "rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.1}))
        out.append((f"is_{level}_icepop_norm_rs_token_k1", {**off, "rollout_is": level, "rollout_is_threshold": "0.5_5.0",
                                                           "rollout_is_batch_normalize": True, "rollout_rs": "token_k1",
                                                           "rollout_rs_threshold": "0.6_1.6"}))
    return out


def presets() -> dict[str, dict]:
    """Every preset factory of verl's RolloutCorrectionConfig (defaults) -> its fields."""
    out = {}
    for name in sorted(vars(RolloutCorrectionConfig)):
        factory = getattr(RolloutCorrectionConfig, name)
        if isinstance(vars(RolloutCorrectionConfig)[name], classmethod):
            cfg = factory()
            if isinstance(cfg, RolloutCorrectionConfig):
                out[name] = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if not f.name.startswith("_")}
    return out


def main() -> None:
    cases = []
    data = {seed: inputs(seed) for seed in (0, 1, 2)}
    for seed, tensors in data.items():
        for name, s in settings():
            try:
                weights, modified_mask, metrics = compute_rollout_correction_and_rejection_mask(
                    old_log_prob=tensors["old_log_probs"], rollout_log_prob=tensors["rollout_log_probs"],
                    response_mask=tensors["response_mask"], **s)
            except Exception as e:  # noqa: BLE001 - verl's own failure on these inputs is part of the record
                cases.append({"name": name, "seed": seed, "settings": s, "verl_raises": f"{type(e).__name__}: {e}"})
                continue
            cases.append({"name": name, "seed": seed, "settings": s,
                          "is_weights": None if weights is None else weights.batch["rollout_is_weights"].tolist(),
                          "modified_response_mask": modified_mask.tolist(),
                          "metrics": {k: float(v) for k, v in sorted(metrics.items())}})
    doc = {"verl_version": verl.__version__, "torch_version": torch.__version__,
           "made_by": "scripts/make_rollout_corr_fixture.py",
           "inputs": {str(seed): {k: v.tolist() for k, v in t.items()} for seed, t in data.items()},
           "presets": presets(), "cases": cases}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, allow_nan=False, indent=None, separators=(",", ":")) + "\n")
    print(f"{len(cases)} cases, {len(doc['presets'])} presets -> {OUT}")


if __name__ == "__main__":
    main()
