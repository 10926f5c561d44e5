"""The distillation teacher's role (``workers/teacher.py``): its log-probs of the student's sampled tokens, and its
top-k log-probs and their ids at every response position (``forward_kl_topk``; ids only below the student's
vocabulary size), equal HF AutoModelForCausalLM's float64 forward, at 1 worker, TP2 and PP2; and a teacher whose
tokenizer is not the student's, or that is no causal LM, or a top k larger than a vocabulary, is refused by
``validate_config`` before any worker starts.

One Ray session; the teacher role is started at each layout in turn and scores one rollout batch (responses of
different lengths, a hole in one mask, right padding). The reference runs HF's model in float64 on each unpadded
prompt + response and takes log_softmax(logits / T) at every response token, written out here.
"""

from __future__ import annotations

import json

import pytest
import torch

from verl_lite.controller import start_ray, stop_ray
from verl_lite.controller.resource_pool import ResourcePool
from verl_lite.controller.role_group import MicroBatching, RoleGroup, start_roles
from verl_lite.data.char_tokenizer import build_char_tokenizer, save_char_tokenizer
from verl_lite.protocol import Batch
from verl_lite.utils.tiny_model import make_tiny_hf_model
from verl_lite.workers.engine_worker import EngineWorkerConfig
from verl_lite.workers.teacher import TeacherWorker

PROMPTS = ["<|user|>12+34=<|assistant|>", "<|user|>7+8=<|assistant|>", "<|user|>99+1=<|assistant|>",
           "<|user|>5+55=<|assistant|>", "<|user|>40+2=<|assistant|>"]
RESPONSES = ["46<eos>", "15<eos>", "100", "60 is it<eos>", "4"]
HOLE = (3, 2)  # (row, position): a token inside the response that the mask leaves out (an observation)
LAYOUTS = {"1 worker": (1, 1, 1), "TP2": (2, 2, 1), "PP2": (2, 1, 2)}  # name: (world, tp, pp)
TEMPERATURE = 0.7
TOL = 1e-5
TOPK, TOPK_BELOW = 6, 100  # the top 6 among ids < 100 of the teacher's 104 (a student with a smaller vocabulary)


def _make_teacher(root):
    """A random Qwen2 (the project's tiny-model builder: weights far from uniform, so a wrong position shows) with
    the char tokenizer the student uses."""
    teacher = make_tiny_hf_model(root / "teacher", "qwen2", vocab_size=104, hidden_size=32, num_layers=2,
                                 intermediate_size=64, max_position_embeddings=128)
    save_char_tokenizer(teacher)
    return teacher


def _rollout_batch(tok) -> Batch:
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    responses = [tok(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    width = max(map(len, responses)) + 2  # right padding past every response
    ids, mask = torch.zeros(len(responses), width, dtype=torch.long), torch.zeros(len(responses), width)
    for i, r in enumerate(responses):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1.0
    mask[HOLE] = 0.0
    return Batch.from_dict({"responses": ids, "response_mask": mask}, {"prompt_ids": prompts})


def _hf_log_probs(teacher_dir, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 log_softmax(logits / T) of each response token given everything before it [n, W] (0 elsewhere),
    and the top ``TOPK`` of those log-probs among ids < ``TOPK_BELOW`` with their ids [n, W, TOPK]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float64).eval()
    tok = build_char_tokenizer()
    out = torch.zeros(batch["response_mask"].shape, dtype=torch.float64)
    top_values = torch.zeros(*out.shape, TOPK, dtype=torch.float64)
    top_ids = torch.zeros(*out.shape, TOPK, dtype=torch.long)
    for i, prompt in enumerate(batch["prompt_ids"]):
        response = tok(RESPONSES[i], add_special_tokens=False)["input_ids"]
        length, seq = len(response), list(prompt) + response
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0]
        for t in range(length):
            position = len(prompt) + t - 1  # the logits that predict response token t
            log_probs = torch.log_softmax(logits[position] / TEMPERATURE, dim=-1)
            out[i, t] = log_probs[seq[position + 1]]
            top_values[i, t], top_ids[i, t] = log_probs[:TOPK_BELOW].topk(TOPK)
    return out, top_values, top_ids


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """{layout: teacher log-probs [n, W]} from the teacher role, the batch and the HF float64 reference."""
    from verl_lite.engine.config import EngineConfig, MegatronConfig

    teacher = _make_teacher(tmp_path_factory.mktemp("teacher_log_probs"))
    batch = _rollout_batch(build_char_tokenizer())
    started = start_ray(num_cpus=2)
    pool = ResourcePool(2)
    results = {}
    try:
        for name, (world, tp, pp) in LAYOUTS.items():
            engine = EngineConfig(str(teacher), MegatronConfig.layout(tp=tp, pp=pp, timeout_s=120), forward_only=True)
            group = RoleGroup("teacher", TeacherWorker, world, EngineWorkerConfig(engine), pool, 300.0)
            start_roles(group)
            try:
                sizing = MicroBatching(micro_batch_size=2)
                results[name] = group.infer("compute_teacher_log_prob", batch, sizing, TEMPERATURE)
                results[name].update(group.infer("compute_teacher_log_prob", batch, sizing, TEMPERATURE, TOPK,
                                                 TOPK_BELOW))
            finally:
                group.shutdown()
    finally:
        pool.remove()
        if started:
            stop_ray()
    return results, batch, _hf_log_probs(teacher, batch)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_teacher_log_probs_match_hf_float64(scored, layout):
    results, batch, (hf, _, _) = scored
    got, mask = results[layout]["teacher_log_probs"], batch["response_mask"]
    assert got.shape == mask.shape
    valid = mask != 0
    err = (got.double() - hf).abs()[valid].max().item()
    assert err < TOL, (layout, err)
    assert hf[valid].std() > 0.1  # log-probs that differ per token: a shifted position would show


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_teacher_topk_matches_hf_float64(scored, layout):
    """Values within the tolerance, largest first; the ids HF's, at every response position the batch holds."""
    results, batch, (_, hf_values, hf_ids) = scored
    values, ids = results[layout]["teacher_topk_log_probs"], results[layout]["teacher_topk_ids"]
    assert values.shape == ids.shape == (*batch["response_mask"].shape, TOPK) and ids.dtype == torch.int32
    scored_positions = torch.arange(values.shape[1])[None, :] < batch["response_mask"].cumsum(1).argmax(1)[:, None] + 1
    err = (values.double() - hf_values).abs()[scored_positions].max().item()
    assert err < TOL, (layout, err)
    assert torch.equal(ids.long()[scored_positions], hf_ids[scored_positions]), layout
    assert int(ids.max()) < TOPK_BELOW and bool((values[scored_positions].diff(dim=-1) <= 0).all())


def _config(teacher_dir, extra=()):
    from verl_lite.config import load_config

    return load_config(["distillation.enabled=true", f"distillation.teacher_model.model_path={teacher_dir}", *extra])


def test_a_teacher_with_another_tokenizer_is_refused_before_start(tmp_path):
    """The same weights with one special token moved: refused with the reason, by validate_config, Ray untouched."""
    import shutil

    import ray

    from verl_lite.config.loader import ConfigError
    from verl_lite.config.validate import validate_config

    was_running = ray.is_initialized()  # an earlier module's shared Ray may still be up: this test starts none
    teacher = _make_teacher(tmp_path)
    assert validate_config(_config(teacher)).world_size == 1  # the same tokenizer: accepted
    other = tmp_path / "other_tokenizer"
    shutil.copytree(teacher, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["7"], vocab["8"] = vocab["8"], vocab["7"]  # two digits swap ids
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError) as err:
        validate_config(_config(other))
    (line,) = [p for p in err.value.problems if "tokenizer is not the student's" in p]
    assert line.startswith(f"distillation.teacher_model.model_path={str(other)!r}: its tokenizer is not the student's")
    assert "the vocabularies differ in 2 tokens" in line and "'7'" in line
    assert ray.is_initialized() == was_running


def test_a_teacher_that_is_no_causal_lm_is_refused(tmp_path):
    from verl_lite.config.loader import ConfigError
    from verl_lite.config.validate import validate_config

    teacher = _make_teacher(tmp_path)
    cfg = json.loads((teacher / "config.json").read_text())
    cfg["architectures"] = ["Qwen2ForSequenceClassification"]
    (teacher / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as err:
        validate_config(_config(teacher))
    assert any(p.startswith(f"distillation.teacher_model.model_path={str(teacher)!r} is a "
                            f"['Qwen2ForSequenceClassification']; a teacher is a causal LM") for p in err.value.problems)


def test_a_topk_larger_than_a_vocabulary_is_refused(tmp_path):
    """forward_kl_topk chooses among the ids both models hold: a top k above the smaller vocabulary is refused with
    both sizes; one at it is accepted."""
    from verl_lite.config.loader import ConfigError
    from verl_lite.config.validate import validate_config

    teacher = _make_teacher(tmp_path)
    topk = ["distillation.distillation_loss.loss_mode=forward_kl_topk"]
    assert validate_config(_config(teacher, topk + ["distillation.distillation_loss.topk=104"])).world_size == 1
    with pytest.raises(ConfigError) as err:
        validate_config(_config(teacher, topk + ["distillation.distillation_loss.topk=105"]))
    (line,) = [p for p in err.value.problems if "topk=105" in p]
    assert "distillation.teacher_model.model_path's vocab_size=104" in line and line.endswith("set topk <= 104")


@pytest.mark.parametrize("extra, lines", [
    ([], ["distillation.teacher_model.n_gpus_per_node=0 must be >= 1 with distillation.teacher_model."
          "enable_resource_pool=true", "distillation.teacher_model.nnodes=0 must be >= 1"]),
    (["distillation.teacher_model.n_gpus_per_node=1", "distillation.teacher_model.nnodes=2"],
     ["a teacher pool of its own is built on one node only"]),
    (["distillation.teacher_model.n_gpus_per_node=1", "distillation.teacher_model.nnodes=1",
      "distillation.teacher_model.megatron.tensor_model_parallel_size=2"],
     ["the teacher's 1 workers (its own pool: n_gpus_per_node x nnodes) must divide by tp*pp*cp = 2*1*1 = 2"]),
])
def test_a_teacher_pool_of_its_own_is_checked_before_start(tmp_path, extra, lines):
    """verl's pool keys (enable_resource_pool, n_gpus_per_node, nnodes): sizes >= 1, one node, and the teacher's
    layout over ITS workers; each problem one line from validate_config. Accepted: one worker of its own."""
    from verl_lite.config import load_config
    from verl_lite.config.loader import ConfigError
    from verl_lite.config.validate import validate_config

    teacher = _make_teacher(tmp_path)
    base = ["distillation.enabled=true", f"distillation.teacher_model.model_path={teacher}",
            "distillation.teacher_model.enable_resource_pool=true"]
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(base + extra))
    for words in lines:
        assert sum(words in p for p in err.value.problems) == 1, (words, err.value.problems)
    one = ["distillation.teacher_model.n_gpus_per_node=1", "distillation.teacher_model.nnodes=1"]
    assert validate_config(load_config(base + one)).world_size == 1
