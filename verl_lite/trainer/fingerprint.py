"""What a checkpoint was trained from, so that a run never resumes another run's checkpoint unnoticed.

    fp = run_fingerprint(cfg, train_dataset)       # a JSON-able dict; saved as global_step_K/fingerprint.json
    differences(saved_fp, fp) -> list[str]          # one line per part that differs; [] = the same run

Three parts, none of which reads a tensor:

- ``model``: sha256 of ``config.json``, of each ``*.safetensors`` header (with the file's size) and of the
  tokenizer files (the chat template lives there);
- ``data``: sha256 of each ``data.train_files`` file, or of the in-memory rows (the Python API); not the
  validation files: a resumed run may validate on other prompts without changing what it trains;
- ``config``: the values of :data:`MATH_KEYS`, the keys that change the objective, the samples or the update.
  Keys that only change how the same math is computed (layouts, micro-batch sizes, dtypes, step counts,
  logging) are not in it, nor the data position keys the driver state already pins.

A differing fingerprint is refused by ``CheckpointManager.prepare_resume``, naming every difference, unless
``trainer.resume_ignore_fingerprint=true``.
"""

from __future__ import annotations

import hashlib
import json
from operator import attrgetter
from pathlib import Path

from verl_lite.data.dataset import IN_MEMORY

FILE = "fingerprint.json"
OVERRIDE_KEY = "trainer.resume_ignore_fingerprint"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
A, R = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"

# the config keys whose change makes a resumed run another run (see the module docstring)
MATH_KEYS = (
    "algorithm.adv_estimator", "algorithm.gamma", "algorithm.lam", "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.use_kl_in_reward", "algorithm.kl_penalty", "algorithm.kl_ctrl.type", "algorithm.kl_ctrl.kl_coef",
    "algorithm.filter_groups.enable", "algorithm.filter_groups.metric",
    f"{A}.ppo_mini_batch_size", f"{A}.ppo_epochs", f"{A}.clip_ratio_low", f"{A}.clip_ratio_high",
    f"{A}.clip_ratio_c", f"{A}.policy_loss.loss_mode", f"{A}.loss_agg_mode", f"{A}.loss_scale_factor",
    f"{A}.entropy_coeff", f"{A}.use_kl_loss", f"{A}.kl_loss_coef", f"{A}.kl_loss_type", f"{A}.tis_imp_ratio_cap",
    f"{A}.optim.lr", f"{A}.optim.weight_decay",
    f"{R}.n", f"{R}.temperature", f"{R}.top_p", f"{R}.top_k",
    "data.max_prompt_length", "data.max_response_length",
    "reward.custom_reward_function.path", "reward.custom_reward_function.name",
    "reward.overlong_buffer.enable", "reward.overlong_buffer.len", "reward.overlong_buffer.penalty_factor",
    "critic.optim.lr", "critic.cliprange_value",
    *(f"algorithm.rollout_correction.{name}" for name in (
        "rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold",
        "rollout_rs_threshold_lower", "rejected_in_denominator", "bypass_mode", "loss_type")),
    "distillation.enabled", "distillation.teacher_model.model_path",
    *(f"distillation.distillation_loss.{name}" for name in (
        "loss_mode", "topk", "use_task_rewards", "distillation_loss_coef", "loss_max_clamp", "log_prob_min_clamp",
        "use_policy_gradient", "policy_loss_mode", "clip_ratio", "clip_ratio_low", "clip_ratio_high")),
)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def model_fingerprint(model_path: str, tokenizer_path: str | None = None) -> dict:
    """``{"path", "config", "weights": {file: {"size", "header"}}, "tokenizer": {file: sha256}}`` of an HF model
    directory (missing files are simply absent: pre-flight has already named them)."""
    from verl_lite.engine.model_files import safetensors_header  # the engine package (torch, version checks): on use

    model = Path(model_path)
    out: dict = {"path": str(model_path), "weights": {}, "tokenizer": {}}
    config = model / "config.json"
    out["config"] = _file_sha256(config) if config.is_file() else None
    for file in sorted(model.glob("*.safetensors")):
        try:
            header = json.dumps(safetensors_header(file), sort_keys=True).encode()
        except (OSError, ValueError):
            header = b"unreadable"
        out["weights"][file.name] = {"size": file.stat().st_size, "header": _sha256(header)}
    for name in TOKENIZER_FILES:
        file = Path(tokenizer_path or model_path) / name
        if file.is_file():
            out["tokenizer"][name] = _file_sha256(file)
    return out


def data_fingerprint(files, dataset=None) -> dict:
    """``{"files": [names], "sha256": [...]}``: each train file hashed, or the in-memory rows themselves."""
    names = [files] if isinstance(files, str) else [str(f) for f in (files or [])]
    if names == [IN_MEMORY] or not names:
        items = getattr(dataset, "items", [])
        rows = json.dumps(items, sort_keys=True, default=str).encode()
        return {"files": [IN_MEMORY], "sha256": [_sha256(rows)]}
    return {"files": names, "sha256": [_file_sha256(Path(f)) if Path(f).is_file() else None for f in names]}


def run_fingerprint(cfg, train_dataset=None) -> dict:
    """The fingerprint of the run ``cfg`` describes (see the module docstring)."""
    m = cfg.actor_rollout_ref.model
    return {"model": model_fingerprint(m.path, m.tokenizer_path),
            "data": data_fingerprint(cfg.data.train_files, train_dataset),
            "config": {key: attrgetter(key)(cfg) for key in MATH_KEYS}}


def _short(names: list[str]) -> str:
    return "[" + ", ".join(Path(n).name for n in names) + "]"


def differences(saved: dict, now: dict) -> list[str]:
    """One line per part of the fingerprint that differs, naming the key and both sides; [] = the same run."""
    out = []
    sm, nm = saved.get("model", {}), now["model"]
    if what := [part for part in ("config", "weights", "tokenizer") if sm.get(part) != nm[part]]:
        out.append(f"the model (actor_rollout_ref.model.path: saved from {sm.get('path')!r}, now {nm['path']!r}; "
                   f"its {' and '.join('config.json' if p == 'config' else p for p in what)} differ)")
    sd, nd = saved.get("data", {}), now["data"]
    if sd.get("sha256") != nd["sha256"]:
        same_names = sd.get("files") == nd["files"]
        out.append(f"the training data (data.train_files: saved {_short(sd.get('files', []))}, now "
                   f"{_short(nd['files'])}{', same names but other content' if same_names else ''})")
    sc = saved.get("config", {})
    for key, value in now["config"].items():
        if key in sc and sc[key] != value:
            out.append(f"{key} (saved {sc[key]!r}, now {value!r})")
    return out
