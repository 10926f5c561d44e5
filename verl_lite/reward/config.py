"""The ``reward`` and ``reward_model`` sections: their fields, defaults and rules, stated once here (``problems``:
one line per problem, naming the key and the fix; no reward code runs while the config is checked), and their
inputs checked against the built datasets' rows (``reward_input_problems``, ``judge_input_problems``)."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional

from verl_lite.engine.config import MegatronConfig, transformer_override_problems
from verl_lite.engine.model_files import model_dir_problem, read_config
from verl_lite.reward.judge import SCORE_PARSERS, template_placeholders
from verl_lite.rollout.config import GenerationConfig, sampling_problems

REWARD_MANAGERS = ("naive", "batch")  # reward.reward_manager's names (verl's dapo is an alias of naive)


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None  # python file; None = built-in default_compute_score
    name: str = "compute_score"  # function in that file
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)  # extra keyword arguments for the function

    def problems(self, key: str = "reward.custom_reward_function") -> list[str]:
        """With a ``path``: the file exists, parses, and names ``name`` at top level, checked WITHOUT running it
        (the reward manager's one import reports the rest, still before anything starts). Without one: no name
        of the user's own (the built-in scorer would run)."""
        path, name = self.path, self.name
        if not path:
            return [] if name == type(self)().name else [
                f"{key}.name={name!r} names a function, but {key}.path is null, so the built-in scorer would run; "
                f"give .path (the python file defining it)"]
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
        return [f"{key}.name={name!r}: {path} defines no function of that name; set {key}.name to one of "
                f"{sorted(functions)}"]


@dataclass
class OverlongBufferConfig:
    """DAPO overlong reward shaping: a linear penalty over the last `len` tokens before the limit."""

    enable: bool = False  # turn on overlong shaping
    len: int = 4  # buffer tokens before data.max_response_length
    penalty_factor: float = 1.0  # penalty at the limit
    log: bool = False  # also report the penalty per step

    def problems(self, max_response_length: int) -> list[str]:
        """When enabled: a buffer within ``data.max_response_length`` and a penalty >= 0."""
        p = []
        if self.enable and not 0 < self.len <= max_response_length:
            p.append(f"reward.overlong_buffer.len={self.len} must lie in (0, data.max_response_length="
                     f"{max_response_length}]")
        if self.enable and not self.penalty_factor >= 0:
            p.append(f"reward.overlong_buffer.penalty_factor={self.penalty_factor} must be >= 0")
        return p


@dataclass
class RewardConfig:
    reward_manager: str = "naive"  # naive (one call per sample) | batch (one call per batch)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    timeout_s: float = 300.0  # bound on each batch call of the reward (a step's or a validation batch's scoring)
    max_memory_gb: float = 4.0  # memory limit (GiB) of a reward file's process and everything it starts, shared memory included; reaching it stops the run; <= 0: none
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)

    def problems(self, max_response_length: int) -> list[str]:
        """A known manager, a timeout > 0, the custom reward file (when given) and the overlong buffer (within
        ``data.max_response_length``)."""
        p = []
        if self.reward_manager not in REWARD_MANAGERS:
            p.append(f"reward.reward_manager={self.reward_manager!r} is unknown; choose one of {list(REWARD_MANAGERS)}")
        if not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            p.append(f"reward.timeout_s={self.timeout_s} must be > 0")
        return p + self.custom_reward_function.problems() + self.overlong_buffer.problems(max_response_length)


ALWAYS_GIVEN = ("prompts", "completions", "data_source", "extra_info")  # what every sample provides


def reward_input_problems(reward, datasets: dict) -> list[str]:
    """What the reward needs from the rows, checked against the built datasets (config key -> dataset) before the
    run starts: ``reward.required_inputs()`` ({function: [row fields]}) in every row, and with the built-in
    scorer a scorer for every ``data_source``."""
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


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = None  # HF AutoModelForSequenceClassification dir with one logit (score.weight), or with generative=true a causal LM (the judge); required with enable
    tokenizer_path: Optional[str] = None  # None = path; a vocabulary or chat template other than the policy's re-renders the text


@dataclass
class RewardModelRolloutConfig(GenerationConfig):
    """The generative judge's rollout (``reward_model.generative=true``; verl's ``reward_model.rollout.*`` names).
    One judge worker of its own (a Ray process next to the actor's rank 0), one generate call per step;
    ``name`` vllm there never meets the policy's engine."""

    do_sample: bool = True  # false: greedy judgements (temperature, top_p, top_k unused)
    prompt_length: int = 2048  # tokens of a rendered judge prompt at most (a longer one stops the step with the fix)
    response_length: int = 2048  # tokens the judge generates at most (its max_new_tokens: the bound on a judgement's length)


# the judge's default prompt: {question}, {response} and (optionally) {reference} are filled in (reward/judge.py)
JUDGE_PROMPT_TEMPLATE = (
    "Grade the response to the question.\n\nQuestion:\n{question}\n\nResponse:\n{response}\n\n"
    "Reply with a score between 0 and 1 (1 = fully correct) as <score>x</score>."
)


@dataclass
class JudgeConfig:
    """How the generative judge is prompted and read (verl_lite's own keys; docs/reward_models.md, "The judge")."""

    prompt_template: str = JUDGE_PROMPT_TEMPLATE  # text with {question}, {response}, optionally {reference} (the row's ground truth); other braces stay as they are
    apply_chat_template: bool = True  # send the rendered text as one user turn in the judge tokenizer's chat template (false, or no template: the text as it is)
    score_parser: str = "tag"  # tag: the number in the LAST `<score>x</score>` | last_number: the last number of the output
    score_min: Optional[float] = 0.0  # a parsed score below this is unparsable; None = no lower bound
    score_max: Optional[float] = 1.0  # a parsed score above this is unparsable; None = no upper bound
    unparsable_score: float = 0.0  # the score of an unparsable judgement (counted in reward_model/judge_unparsable_rate)
    timeout_s: float = 300.0  # bound on the step's one judge generate call; past it the step fails naming this key (the judge worker is stopped)

    def problems(self, J: str = "reward_model.judge") -> list[str]:
        """A known parser, a template with {response}, finite scores and bounds in order, a positive timeout."""
        p = []
        if self.score_parser not in SCORE_PARSERS:
            p.append(f"{J}.score_parser={self.score_parser!r} is unknown; choose one of {list(SCORE_PARSERS)}")
        if not isinstance(self.prompt_template, str) or "response" not in template_placeholders(self.prompt_template):
            p.append(f"{J}.prompt_template must hold {{response}} (the judged text); it may hold {{question}} and "
                     f"{{reference}} (the row's ground truth)")
        if not _finite(self.unparsable_score):
            p.append(f"{J}.unparsable_score={self.unparsable_score!r} must be a finite number (the score of an "
                     f"unparsable judgement)")
        for name in ("score_min", "score_max"):
            if getattr(self, name) is not None and not _finite(getattr(self, name)):
                p.append(f"{J}.{name}={getattr(self, name)!r} must be a finite number or null (no bound)")
        if _finite(self.score_min) and _finite(self.score_max) and self.score_min > self.score_max:
            p.append(f"{J}.score_min={self.score_min} must be <= {J}.score_max={self.score_max}")
        if not (_finite(self.timeout_s) and self.timeout_s > 0):
            p.append(f"{J}.timeout_s={self.timeout_s!r} must be a number > 0 (seconds; the bound on a step's judge call)")
        return p


@dataclass
class RewardModelConfig:
    """A reward model: a discriminative score head read at the last token, on the actor's workers, or (generative=true) an LLM judge behind a rollout (docs/reward_models.md)."""

    enable: bool = False  # score every training response with the model; validation stays with the reward function
    generative: bool = False  # false: model.path is a one-logit classifier on the engine; true: a causal LM judge (reward_model.rollout.*, reward_model.judge.*)
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    micro_batch_size_per_gpu: Optional[int] = None  # sequences per forward micro-batch; None = rollout.log_prob_micro_batch_size_per_gpu
    rule_reward_weight: float = 0.0  # training score = RM score + this x the reward function's; 0 = the RM alone (verl)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # its own layout over the actor's workers
    rollout: RewardModelRolloutConfig = field(default_factory=RewardModelRolloutConfig)  # generative only: the judge's backend and sampling
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # generative only: prompt template, score parser, timeout

    def problems(self, world: int, cuda: bool = False) -> list[str]:
        """When enabled: an HF sequence-classification checkpoint with ONE logit (its ``score.weight`` is the
        engine's value head) and a layout of its own over the actor's ``world`` workers; or the judge's."""
        if not self.enable:
            return []
        what = "judge" if self.generative else "reward model"
        p = [] if _finite(self.rule_reward_weight) else [f"reward_model.rule_reward_weight={self.rule_reward_weight!r} "
                                                          f"must be a finite number (0 = the {what} alone)"]
        tok = self.model.tokenizer_path
        if tok and not any((Path(tok) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            p.append(f"reward_model.model.tokenizer_path={tok!r} holds no tokenizer.json/tokenizer_config.json")
        return p + (self._judge_problems(cuda) if self.generative else self._classifier_problems(world, cuda))

    def _model(self, needs: str, arch_suffix: str, arch_rule: str) -> tuple[list[str], dict | None]:
        """``model.path``: given, an HF model directory of an architecture ending in ``arch_suffix``; (problems,
        its HF config or None)."""
        key, path = "reward_model.model.path", self.model.path
        if not path:
            return [f"reward_model.{'generative' if self.generative else 'enable'}=true needs {key}: {needs}"], None
        why = model_dir_problem(key, path, f"(no default: give the {'judge' if self.generative else 'RM'})")
        p = [why] if why else []
        cfg = read_config(path)
        if cfg is not None and not _arch_fits(cfg, arch_suffix):
            p.append(f"{key}={path!r} is a {cfg.get('architectures') or 'model without architectures'}; {arch_rule}")
        return p, cfg

    def _classifier_problems(self, world: int, cuda: bool) -> list[str]:
        p, cfg = self._model("an HF AutoModelForSequenceClassification directory with one logit (e.g. "
                             "Qwen2ForSequenceClassification, as Skywork-Reward ships)", "ForSequenceClassification",
                             "a reward model is an AutoModelForSequenceClassification checkpoint (model.* + "
                             "score.weight)")
        if not self.model.path:
            return self._set_judge_keys() + p
        labels = (cfg or {}).get("num_labels", len((cfg or {}).get("id2label") or {}) or 2)  # HF's default is 2 labels
        if _arch_fits(cfg, "ForSequenceClassification") and labels != 1:
            p.append(f"reward_model.model.path={self.model.path!r} has {labels} labels; a reward model has one logit "
                     f"(num_labels=1, score.weight [1, hidden])")
        mb, mg = self.micro_batch_size_per_gpu, self.megatron
        if not _ints(mb) or mb < 1:
            p.append(f"reward_model.micro_batch_size_per_gpu={mb} must be an integer >= 1 (sequences per forward "
                     f"micro-batch)")
        p.extend(mg.problems("reward_model.megatron", world,
                             "the reward model's {world} workers (colocated: the actor's)", cfg))
        p.extend(transformer_override_problems("reward_model.megatron.override_transformer_config",
                                               mg.override_transformer_config, dtype=mg.dtype, cuda=cuda))
        return self._set_judge_keys() + p

    def _set_judge_keys(self) -> list[str]:
        """A discriminative RM with judge settings: each set key and why it does not apply (none is ignored)."""
        return [f"reward_model.{sec}.{name}={value!r}: configures the generative judge (reward_model.generative=true); "
                f"the discriminative reward model runs on the megatron engine (its layout: reward_model.megatron.*): "
                f"drop it, or set reward_model.generative=true with a causal-LM judge"
                for sec in ("rollout", "judge") for name, value in _differing(getattr(self, sec))]

    def _judge_problems(self, cuda: bool) -> list[str]:
        """``generative=true``: a causal-LM judge, a backend that runs here, bounds that fit the judge model; the
        discriminative RM's engine settings (``reward_model.megatron.*``) must stay unset."""
        R, r = "reward_model.rollout", self.rollout
        longest = r.prompt_length + r.response_length if _ints(r.prompt_length, r.response_length) else None
        p = [f"reward_model.megatron.{name}={value!r} is the discriminative reward model's engine layout; the "
             f"generative judge runs behind {R}.name (one process of its own): drop it"
             for name, value in _differing(self.megatron)]
        found, cfg = self._model("an HF causal-LM directory (the judge; the policy's own checkpoint works too)",
                                 "ForCausalLM", "a generative judge is a causal LM (*ForCausalLM) that writes its "
                                 "judgement (a classifier: reward_model.generative=false)")
        max_pos = (cfg or {}).get("max_position_embeddings")
        if isinstance(max_pos, int) and longest is not None and longest > max_pos:
            found.append(f"{R}.prompt_length + {R}.response_length = {longest} exceeds the judge model's "
                         f"max_position_embeddings {max_pos}; lower them (a judge prompt + its judgement must fit)")
        p += found + r.generation_problems(R, longest, cuda, what="judge")
        for name in ("prompt_length", "response_length"):
            if not _ints(getattr(r, name)) or getattr(r, name) < 1:
                p.append(f"{R}.{name}={getattr(r, name)!r} must be an integer >= 1 (tokens)")
        p += sampling_problems(R, r.temperature, r.top_p, r.top_k, r.do_sample, "do_sample=false for greedy judgements")
        return p + self.judge.problems()


def _arch_fits(cfg: dict | None, suffix: str) -> bool:
    return any(str(a).endswith(suffix) for a in (cfg or {}).get("architectures") or [])


def _differing(section) -> list[tuple[str, object]]:
    """(field, value) of the dataclass ``section`` that differ from its class's defaults."""
    default = type(section)()
    return [(f.name, getattr(section, f.name)) for f in dataclasses.fields(default)
            if getattr(section, f.name) != getattr(default, f.name)]


def judge_input_problems(rm, datasets: dict) -> list[str]:
    """A judge template that names ``{reference}`` needs a ground truth in every training row (validation is
    scored by the reward function). ``datasets``: config key -> dataset (``RLDataset``)."""
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
