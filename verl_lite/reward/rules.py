"""The reward section's rules, stated once here and collected by ``verl_lite.config.validate``
(stdlib only: no reward code runs and nothing heavy is imported while the config is checked).

    reward_problems(reward_section) -> list[str]   # one line per problem, naming the key
    reward_input_problems(reward, {"data.train_files": dataset, ...}) -> list[str]
                                                   # the reward's inputs vs the built datasets' rows
    reward_model_problems(reward_model_section, world) -> list[str]   # the RM role or the judge (when enabled)
    judge_input_problems(reward_model_section, datasets) -> list[str]  # the judge template's {reference} vs the rows
"""

from __future__ import annotations

import ast
from pathlib import Path

REWARD_MANAGERS = ("naive", "batch")  # reward.reward_manager's names (verl's dapo is an alias of naive)


def reward_problems(rw) -> list[str]:
    """The ``reward`` section: a known manager and, when given, a custom reward file that defines the name."""
    p = []
    if rw.reward_manager not in REWARD_MANAGERS:
        p.append(f"reward.reward_manager={rw.reward_manager!r} is unknown; choose one of {list(REWARD_MANAGERS)}")
    crf = rw.custom_reward_function
    if crf.path:
        p.extend(reward_function_problems(crf.path, crf.name, "reward.custom_reward_function"))
    elif crf.name != type(crf)().name:  # a name of the user's own, and no file to find it in
        p.append(f"reward.custom_reward_function.name={crf.name!r} names a function, but reward.custom_reward_function"
                 f".path is null, so the built-in scorer would run; give .path (the python file defining it)")
    return p


def reward_function_problems(path: str, name: str, key: str) -> list[str]:
    """The file exists, parses, and names `name` at top level, checked WITHOUT running it: the reward
    manager imports it exactly once, in the reward process, and reports import errors and a
    signature that does not fit reward_kwargs there (still before anything starts)."""
    file = Path(path)
    if file.is_dir():
        return [f"{key}.path={path!r} is a directory; give the path of a python file in it defining '{name}'"]
    if not file.is_file():
        return [f"{key}.path={path!r} does not exist; give the path of a python file defining '{name}'"]
    try:
        tree = ast.parse(file.read_text(), filename=str(file))
    except (SyntaxError, ValueError, UnicodeDecodeError) as e:
        return [f"{key}.path={path!r} does not parse ({type(e).__name__}: {e}); fix the file"]
    defined: set[str] = set()
    functions: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
            if not node.name.startswith("_"):
                functions.append(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update(name if a.name == "*" else (a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif not isinstance(node, (ast.Expr,)):
            defined.add(name)  # defined under if/try/...: leave the check to the reward manager's import
    if name in defined:
        return []
    return [f"{key}.name={name!r}: {path} defines no function of that name; set {key}.name to one of {sorted(functions)}"]


ALWAYS_GIVEN = ("prompts", "completions", "data_source", "extra_info")  # what every sample provides


def reward_input_problems(reward, datasets: dict) -> list[str]:
    """What the reward needs from the rows, checked against the built datasets before the run starts:
    ``reward.required_inputs()`` ({function: [row fields]}) must be in every row (``ground_truth`` in
    ``dataset.rows_without_ground_truth``' complement, any other name among ``dataset.columns``), and
    with the built-in scorer every ``data_source`` must have one. ``datasets``: config key -> dataset."""
    from verl_lite.reward.scorers import builtin_scorer

    p = []
    for key, ds in datasets.items():
        if ds is None:  # e.g. no validation set
            continue
        for fn, names in reward.required_inputs().items():
            for name in names:
                p.extend(_missing_input(key, ds, fn, name, reward.builtin))
        if reward.builtin:
            sources = sorted({it["data_source"] for it in ds.items if builtin_scorer(it["data_source"]) is None})
            if sources:
                p.append(f"{key}: no built-in scorer for data_source {sources} (built-in: synthetic/addition, "
                         f"gsm8k, MATH-style sources); pass reward_funcs= (Python API) or set "
                         f"reward.custom_reward_function.path/name")
    return p


def _missing_input(key: str, ds, fn: str, name: str, builtin: bool) -> list[str]:
    if name in ALWAYS_GIVEN:
        return []
    if name == "ground_truth":
        rows = ds.rows_without_ground_truth
        if not rows:
            return []
        hint = f"; or read the rows' {ds.columns} by name in reward functions of your own" if ds.columns else ""
        return [f"{key}: {len(rows)} row(s) have no ground truth (first: {rows[0]}) and the reward {fn} needs one; "
                f"give each row 'reward_model': {{'ground_truth': ...}} or a 'ground_truth' column{hint}"]
    if name in ds.columns:
        return []
    return [f"{key}: the reward function {fn} needs {name!r}, which not every row has (columns every row has: "
            f"{ds.columns}); add the column to the rows, or give the parameter a default"]


def reward_model_problems(rm, world: int, cuda: bool = False) -> list[str]:
    """The ``reward_model`` section when enabled: an HF sequence-classification checkpoint with ONE logit
    (its ``score.weight`` is the engine's value head), a tokenizer, a micro-batch size and a layout of its
    own over the actor's ``world`` workers (colocated; engine/rules' layout rules)."""
    from verl_lite.engine import rules as engine_rules
    from verl_lite.engine.model_files import model_dir_problem, read_config

    key = "reward_model"
    if not rm.enable:
        return []
    if rm.generative:
        return judge_problems(rm, cuda)
    p = [f"{key}.{name}: {why}" for name, why in _set_judge_keys(rm)]
    if not rm.model.path:
        return p + [f"{key}.enable=true needs {key}.model.path: an HF AutoModelForSequenceClassification directory "
                    f"with one logit (e.g. Qwen2ForSequenceClassification, as Skywork-Reward ships)"]
    p += list(filter(None, [model_dir_problem(f"{key}.model.path", rm.model.path, "(no default: give the RM)")]))
    cfg = read_config(rm.model.path)
    if cfg is not None:
        arch = cfg.get("architectures") or []
        labels = cfg.get("num_labels", len(cfg.get("id2label") or {}) or 2)  # HF's default is 2 labels
        if not any(str(a).endswith("ForSequenceClassification") for a in arch):
            p.append(f"{key}.model.path={rm.model.path!r} is a {arch or 'model without architectures'}; a reward "
                     f"model is an AutoModelForSequenceClassification checkpoint (model.* + score.weight)")
        elif labels != 1:
            p.append(f"{key}.model.path={rm.model.path!r} has {labels} labels; a reward model has one logit "
                     f"(num_labels=1, score.weight [1, hidden])")
    tok = rm.model.tokenizer_path
    if tok and not any((Path(tok) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        p.append(f"{key}.model.tokenizer_path={tok!r} holds no tokenizer.json/tokenizer_config.json")
    mb = rm.micro_batch_size_per_gpu
    if mb is None or not isinstance(mb, int) or isinstance(mb, bool) or mb < 1:
        p.append(f"{key}.micro_batch_size_per_gpu={mb} must be an integer >= 1 (sequences per forward micro-batch)")
    w = rm.rule_reward_weight
    if not isinstance(w, (int, float)) or isinstance(w, bool) or not abs(w) < float("inf"):
        p.append(f"{key}.rule_reward_weight={w!r} must be a finite number (0 = the reward model alone)")
    mg = rm.megatron
    p.extend(mg.problems(f"{key}.megatron", world, "the reward model's {world} workers (colocated: the actor's)", cfg))
    p.extend(engine_rules.transformer_override_problems(f"{key}.megatron.override_transformer_config",
                                                        mg.override_transformer_config, dtype=mg.dtype, cuda=cuda))
    return p


JUDGE_SECTIONS = ("rollout", "judge")  # the generative judge's own sections of reward_model


def _differing(section) -> list[tuple[str, object]]:
    """(field, value) of the dataclass ``section`` that differ from its class's defaults."""
    import dataclasses

    default = type(section)()
    return [(f.name, getattr(section, f.name)) for f in dataclasses.fields(default)
            if getattr(section, f.name) != getattr(default, f.name)]


def _set_judge_keys(rm) -> list[tuple[str, str]]:
    """A discriminative RM with judge settings: each set key and why it does not apply (none is ignored)."""
    why = ("configures the generative judge (reward_model.generative=true); the discriminative reward model runs on "
           "the megatron engine (its layout: reward_model.megatron.*): drop it, or set reward_model.generative=true "
           "with a causal-LM judge")
    return [(f"{sec}.{name}={value!r}", why) for sec in JUDGE_SECTIONS for name, value in _differing(getattr(rm, sec))]


def judge_problems(rm, cuda: bool = False) -> list[str]:
    """``reward_model.generative=true``: a causal-LM judge directory and tokenizer, a known backend that runs here,
    sampling and length bounds that fit the judge model, a known parser, a finite unparsable score, a positive
    timeout; the discriminative RM's engine settings (``reward_model.megatron.*``) must stay unset."""
    from verl_lite.engine.model_files import model_dir_problem, read_config
    from verl_lite.reward.judge import SCORE_PARSERS, template_placeholders
    from verl_lite.rollout.rules import generation_problems

    key, R, J = "reward_model", "reward_model.rollout", "reward_model.judge"
    r, j, p = rm.rollout, rm.judge, []
    longest = r.prompt_length + r.response_length if _ints(r.prompt_length, r.response_length) else None
    p += [f"{key}.megatron.{name}={value!r} is the discriminative reward model's engine layout; the generative judge "
          f"runs behind {R}.name (one process of its own): drop it"
          for name, value in _differing(rm.megatron)]
    if not rm.model.path:
        p.append(f"{key}.generative=true needs {key}.model.path: an HF causal-LM directory (the judge; the policy's "
                 f"own checkpoint works too)")
    else:
        p += list(filter(None, [model_dir_problem(f"{key}.model.path", rm.model.path, "(no default: give the judge)")]))
        cfg = read_config(rm.model.path)
        arch = (cfg or {}).get("architectures") or []
        if cfg is not None and not any(str(a).endswith("ForCausalLM") for a in arch):
            p.append(f"{key}.model.path={rm.model.path!r} is a {arch or 'model without architectures'}; a generative "
                     f"judge is a causal LM (*ForCausalLM) that writes its judgement (a classifier: "
                     f"{key}.generative=false)")
        max_pos = (cfg or {}).get("max_position_embeddings")
        if isinstance(max_pos, int) and longest is not None and longest > max_pos:
            p.append(f"{R}.prompt_length + {R}.response_length = {longest} exceeds the judge model's "
                     f"max_position_embeddings {max_pos}; lower them (a judge prompt + its judgement must fit)")
    tok = rm.model.tokenizer_path
    if tok and not any((Path(tok) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        p.append(f"{key}.model.tokenizer_path={tok!r} holds no tokenizer.json/tokenizer_config.json")
    p += generation_problems(R, r, longest, cuda, what="judge")
    for name in ("prompt_length", "response_length"):
        if not _ints(getattr(r, name)) or getattr(r, name) < 1:
            p.append(f"{R}.{name}={getattr(r, name)!r} must be an integer >= 1 (tokens)")
    if r.do_sample and not r.temperature > 0:
        p.append(f"{R}.temperature={r.temperature} must be > 0 when sampling (do_sample=false for greedy judgements)")
    if not 0.0 < r.top_p <= 1.0:
        p.append(f"{R}.top_p={r.top_p} must lie in (0, 1]")
    if r.top_k < -1:
        p.append(f"{R}.top_k={r.top_k} must be -1/0 (disabled) or a positive count")
    if j.score_parser not in SCORE_PARSERS:
        p.append(f"{J}.score_parser={j.score_parser!r} is unknown; choose one of {list(SCORE_PARSERS)}")
    if not isinstance(j.prompt_template, str) or "response" not in template_placeholders(j.prompt_template):
        p.append(f"{J}.prompt_template must hold {{response}} (the judged text); it may hold {{question}} and "
                 f"{{reference}} (the row's ground truth)")
    if not _finite(j.unparsable_score):
        p.append(f"{J}.unparsable_score={j.unparsable_score!r} must be a finite number (the score of an unparsable "
                 f"judgement)")
    for name in ("score_min", "score_max"):
        if getattr(j, name) is not None and not _finite(getattr(j, name)):
            p.append(f"{J}.{name}={getattr(j, name)!r} must be a finite number or null (no bound)")
    if _finite(j.score_min) and _finite(j.score_max) and j.score_min > j.score_max:
        p.append(f"{J}.score_min={j.score_min} must be <= {J}.score_max={j.score_max}")
    if not (_finite(j.timeout_s) and j.timeout_s > 0):
        p.append(f"{J}.timeout_s={j.timeout_s!r} must be a number > 0 (seconds; the bound on a step's judge call)")
    w = rm.rule_reward_weight
    if not _finite(w):
        p.append(f"{key}.rule_reward_weight={w!r} must be a finite number (0 = the judge alone)")
    return p


def judge_input_problems(rm, datasets: dict) -> list[str]:
    """A judge template that names ``{reference}`` needs a ground truth in every training row (validation is
    scored by the reward function). ``datasets``: config key -> dataset (``RLDataset``)."""
    from verl_lite.reward.judge import template_placeholders

    if not (rm.enable and rm.generative) or "reference" not in template_placeholders(rm.judge.prompt_template):
        return []
    ds = datasets.get("data.train_files")
    rows = getattr(ds, "rows_without_ground_truth", None) or [] if ds is not None else []
    if not rows:
        return []
    return [f"data.train_files: {len(rows)} row(s) have no ground truth (first: {rows[0]}) and "
            f"reward_model.judge.prompt_template names {{reference}}; give each row 'reward_model': "
            f"{{'ground_truth': ...}} or drop {{reference}} from the template"]


def _ints(*values) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < float("inf")
