"""Engine state <-> megatron-core ``dist_checkpointing`` (sharded, layout-independent; collective).

Saved: the chunks' ``sharded_state_dict()`` (global keys: TP/PP/VPP/CP/DP may change between save and load),
the optimizer state (megatron's fully reshardable format) and the LR schedule; the engine draws no random
numbers while training, so there is no engine RNG to store. :func:`check_dist_dir` validates a directory before
a load: nothing in it is trusted beyond plain tensors and bounded metadata (docs/checkpoints.md, "Safety").
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
from pathlib import Path

import torch

from verl_lite.compat import megatron_internals, torch_dcp
from verl_lite.compat.torch_dcp import restricted_metadata_unpickling
from verl_lite.engine.hf_bridge import export_hf
from verl_lite.engine.lora import export_adapter_state, save_peft_adapter
from verl_lite.engine.model import unwrap_model
from verl_lite.engine.config import canonical_dtype
from verl_lite.engine.vocab_parallel import padded_vocab_size
from verl_lite.utils import safe_files
from verl_lite.utils.processes import forked_children_die_with_parent

RestrictedUnpickler = torch_dcp.RestrictedUnpickler  # re-exported
# Reshardable in TP, PP, VPP, CP and DP, and readable by the regular optimizer.
SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
FORMAT_FILE = "verl_lite_engine.json"
FORMAT_VERSION = 1


class CheckpointLayoutError(ValueError):
    """A checkpoint cannot be loaded into this engine (the message says which change is not supported)."""


class UnsafeCheckpointFile(ValueError):
    """A checkpoint file cannot be read safely: it does not parse, it reaches outside the checkpoint, or it
    would unpickle a global outside the allow-list (the message names the file and what was refused)."""


METADATA_FILE = ".metadata"
INDEX_LIMIT = 1 << 30  # the dist-checkpoint index's size bound (one record per saved shard piece)
COMMON_LIMIT = 64 << 20  # common.pt: optimizer hyper-parameters, step counters, the LR schedule
MEGATRON_FORMAT_FILE = "metadata.json"  # megatron's format marker


def _read_checked(directory, name: str, limit: int, parse, what: str, kind: type, refusals=()):
    """``parse`` of ``<directory>/<name>`` read size-bounded, which must give a ``kind``;
    :class:`UnsafeCheckpointFile` naming the file for anything refused (``refusals``: said as they are) or
    unreadable."""
    path = Path(directory) / name
    try:
        value = parse(safe_files.read_bounded(directory, name, limit))
    except safe_files.UnsafeFile as err:
        raise UnsafeCheckpointFile(str(err)) from None
    except refusals as err:
        raise UnsafeCheckpointFile(f"{path}: {err}") from None
    except Exception as err:  # a damaged file fails in many ways (EOFError, KeyError, TypeError, ...)
        raise UnsafeCheckpointFile(f"{path}: not a readable {what} ({type(err).__name__}: {err})") from None
    if not isinstance(value, kind):
        raise UnsafeCheckpointFile(f"{path}: holds a {type(value).__name__}, not a {what}")
    return value


def read_dist_metadata(directory: str | Path):
    """``<directory>/.metadata`` (the dist-checkpoint index) through the restricted unpickler."""
    from torch.distributed.checkpoint.metadata import Metadata

    return _read_checked(directory, METADATA_FILE, INDEX_LIMIT, torch_dcp.loads_index,
                         "torch.distributed.checkpoint index", Metadata, refusals=pickle.UnpicklingError)


def check_dist_dir(directory: str | Path) -> dict:
    """Everything a load of ``directory`` (a ``dist/`` of :func:`save_engine_state`) will read, checked first
    as the module docstring says (no tensor data is read); returns the saver's description. Raises
    :class:`UnsafeCheckpointFile` (or :class:`CheckpointLayoutError` for the description) naming the file."""
    directory = Path(directory)
    saved = read_engine_description(directory)
    index = read_dist_metadata(directory)
    try:
        entries = torch_dcp.storage_entries(index)
    except ValueError as err:
        raise UnsafeCheckpointFile(f"{directory / METADATA_FILE}: {err}") from None
    sizes: dict[str, int] = {}
    try:
        for name, offset, length in entries:
            if not safe_files.is_plain_relative(name, depth=1):
                raise safe_files.UnsafeFile(f"{directory / METADATA_FILE}: storage entry {name!r} is not a file "
                                            f"name of this directory (a path, or with '..')")
            if name not in sizes:
                sizes[name] = safe_files.size_inside(directory, name)
            if offset < 0 or length < 0 or offset + length > sizes[name]:
                raise safe_files.UnsafeFile(f"{directory / METADATA_FILE}: places {length} bytes at offset {offset} "
                                            f"of {name}, which holds {sizes[name]}")
        safe_files.read_json(directory, MEGATRON_FORMAT_FILE)
    except safe_files.UnsafeFile as err:
        raise UnsafeCheckpointFile(str(err)) from None
    read_common_state(directory)
    return saved


def read_common_state(directory: str | Path) -> dict:
    """``<directory>/common.pt`` with ``torch.load(weights_only=True)``: a dict of plain data and tensors."""
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    def parse(data: bytes):
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)

    return _read_checked(directory, COMMON_STATE_FNAME, COMMON_LIMIT, parse, "common state", dict)


def _safe_common_strategy():
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class SafeCommonLoad(TorchCommonLoadStrategy):
        """``common.pt`` with ``torch.load(weights_only=True)``; ShardedObjects are refused."""

        def load_common(self, checkpoint_dir):
            return read_common_state(checkpoint_dir)

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            _reject_sharded_objects(sharded_objects_state_dict)
            return sharded_objects_state_dict

    return SafeCommonLoad()


def _reject_sharded_objects(sharded_state_dict) -> None:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    objects = [v.key for v in nested_values(sharded_state_dict) if isinstance(v, ShardedObject)]
    if objects:
        raise CheckpointLayoutError(
            f"the engine state holds ShardedObjects {objects[:3]} (pickled blobs); verl_lite refuses to load "
            f"pickled objects from a checkpoint")


# ---------------------------------------------------------------------------- state dicts
def _is_empty_extra_state(value) -> bool:
    return value is None or (isinstance(value, io.BytesIO) and value.getbuffer().nbytes == 0) or (
        isinstance(value, torch.Tensor) and value.numel() == 0)


def _drop_empty_extra_state(node):
    """Remove the ``*._extra_state`` ShardedObjects megatron's local linear layers emit with no content
    (they would be pickled blobs); raise for one that holds data (it could not be restored)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if isinstance(v, ShardedObject) and v.key.endswith("_extra_state"):
                if not _is_empty_extra_state(v.data):
                    raise CheckpointLayoutError(f"{v.key} holds extra state, which verl_lite cannot store without pickling")
                continue
            out[k] = _drop_empty_extra_state(v)
        return out
    if isinstance(node, list):
        return [_drop_empty_extra_state(v) for v in node]
    return node


def _model_sharded_state_dict(chunks) -> dict:
    return {f"model{i}": _drop_empty_extra_state(unwrap_model(c).sharded_state_dict()) for i, c in enumerate(chunks)}


def _load_model_state(chunks, loaded: dict) -> None:
    """The loaded ``model{i}`` state dicts into the chunks; raise naming missing or unexpected keys."""
    for i, chunk in enumerate(chunks):
        missing, unexpected = unwrap_model(chunk).load_state_dict(loaded[f"model{i}"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise CheckpointLayoutError(f"model chunk {i}: missing {missing[:5]}, unexpected {unexpected[:5]}")


def _init_optimizer_state(optimizer) -> None:
    """Give every parameter Adam state (zeros, step 0) so megatron can describe the state to load into
    (a fresh distributed optimizer has none and its ``state_dict()`` needs a step). The load overwrites it."""
    for opt in megatron_internals.each_optimizer(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                st = inner.state[p]
                if len(st) == 0:
                    st["exp_avg"] = torch.zeros_like(p.data)
                    st["exp_avg_sq"] = torch.zeros_like(p.data)
                    st["step"] = torch.zeros((), dtype=torch.float32)


def _engine_sharded_state_dict(engine, is_loading: bool, with_optimizer: bool) -> dict:
    state = _model_sharded_state_dict(engine.chunks)
    if with_optimizer:
        if is_loading:
            _init_optimizer_state(engine.optimizer)
        state["optimizer"] = engine.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=SHARDING_METADATA)
        state["scheduler"] = engine.scheduler.state_dict()
    return state


def _describe(engine) -> dict:
    """What the saver was (written as JSON next to the shards; compared on load for clear errors)."""
    hf = engine.hf_config
    return {
        "format_version": FORMAT_VERSION,
        "layout": {"tp": engine.tp, "pp": engine.pp, "vpp": engine.vpp, "cp": engine.cp, "dp": engine.dp,
                   "ep": engine.cfg.megatron.ep},
        "value_head": bool(engine.cfg.value_head),
        "with_optimizer": engine.optimizer is not None,
        # expert weights reduced over the expert-data-parallel group, in an optimizer of their own (EP > 1, or TP > 1
        # at EP = 1: compat.megatron_internals.reduce_replicated_experts)
        "expert_optimizer": any(not getattr(p, "allreduce", True) for chunk in engine.chunks for p in chunk.parameters()),
        "use_distributed_optimizer": bool(engine.optimizer is not None and engine.cfg.megatron.use_distributed_optimizer),
        "params_dtype": canonical_dtype(engine.cfg.megatron.dtype),
        "padded_vocab_size": padded_vocab_size(hf.vocab_size, engine.tp),
        "model": {k: getattr(hf, k, None) for k in (
            "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "tie_word_embeddings")},
    }


def _barrier():
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def save_engine_state(engine, directory: str | Path) -> None:
    """Write the engine's model (+ optimizer + LR schedule when trainable) into ``directory`` (empty or absent,
    on a file system all ranks see). Collective; each tensor shard is written once."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
    _barrier()
    state = _engine_sharded_state_dict(engine, is_loading=False, with_optimizer=engine.optimizer is not None)
    _reject_sharded_objects(state)
    megatron_internals.in_process_save_results()
    with forked_children_die_with_parent():  # megatron forks its shard writers: none outlives a killed rank
        dist_checkpointing.save(state, str(directory), sharded_strategy=("torch_dist", 1),
                                validate_access_integrity=True, content_metadata=SHARDING_METADATA)
    if _rank() == 0:
        (directory / FORMAT_FILE).write_text(json.dumps(_describe(engine), indent=1))
    _barrier()


_DESCRIPTION_TYPES = {"format_version": int, "layout": dict, "value_head": bool, "with_optimizer": bool,
                      "use_distributed_optimizer": bool, "params_dtype": str, "padded_vocab_size": int, "model": dict}


def read_engine_description(directory: str | Path) -> dict:
    """The saver's description (``FORMAT_FILE``), size-bounded and checked to hold each field with its type
    (:class:`CheckpointLayoutError` naming the file otherwise)."""
    path = Path(directory) / FORMAT_FILE
    try:
        saved = safe_files.read_json(directory, FORMAT_FILE)
    except safe_files.UnsafeFile as err:
        raise CheckpointLayoutError(f"{err}; not an engine checkpoint written by verl_lite") from None
    optional = ("padded_vocab_size", "params_dtype")  # absent in saves before they existed
    wrong = [k for k, kind in _DESCRIPTION_TYPES.items() if not isinstance(saved, dict) or
             not (isinstance(saved.get(k), kind) or (k in optional and k not in saved))]
    if not wrong:
        wrong = [f"layout.{k}" for k in ("tp", "pp", "cp", "dp") if type(saved["layout"].get(k)) is not int]
    if wrong:
        raise CheckpointLayoutError(f"{path}: malformed {', '.join(wrong)}; not an engine checkpoint written by verl_lite")
    return saved


def _check_padded_vocab(saved: dict, here: dict) -> None:
    """The embedding / LM-head row count (``padded_vocab_size``) must not change: megatron reshards a
    tensor over TP but cannot change its global shape. The same at every power-of-two TP."""
    saved_rows = saved.get("padded_vocab_size", saved["model"].get("vocab_size"))  # before padding: unpadded
    if saved_rows == here["padded_vocab_size"]:
        return
    vocab = here["model"]["vocab_size"]
    fits = [t for t in range(1, 129) if padded_vocab_size(vocab, t) == saved_rows]
    raise CheckpointLayoutError(
        f"the checkpoint's embedding and LM head have {saved_rows} rows (vocab_size={vocab} padded at "
        f"tp={saved['layout']['tp']}) and this engine builds {here['padded_vocab_size']} (tp={here['layout']['tp']}): "
        f"megatron cannot reshard a vocabulary padded to another size; load it at a TP that pads to {saved_rows} "
        f"rows ({'tp in ' + str(fits[:8]) if fits else 'none does'}), or export the weights in the saved layout "
        f"and start from them")


def check_compatible(engine, saved: dict) -> None:
    """Raise :class:`CheckpointLayoutError` for a change resharding cannot do (the parallel layout may change)."""
    here = _describe(engine)
    if saved.get("format_version") != FORMAT_VERSION:
        raise CheckpointLayoutError(f"engine checkpoint format {saved.get('format_version')} != {FORMAT_VERSION}")
    diffs = [f"{k}: saved {saved['model'].get(k)!r}, now {v!r}" for k, v in here["model"].items()
             if saved["model"].get(k) != v]
    if diffs:
        raise CheckpointLayoutError("the checkpoint holds a different model architecture (not a layout change): "
                                    + "; ".join(diffs))
    _check_padded_vocab(saved, here)
    if saved["value_head"] != here["value_head"]:
        kind = {True: "a critic (value head)", False: "an LM (policy)"}
        raise CheckpointLayoutError(f"the checkpoint holds {kind[saved['value_head']]} but this engine is "
                                    f"{kind[here['value_head']]}")
    if here["with_optimizer"] and saved["with_optimizer"] and (
            here["use_distributed_optimizer"] != saved["use_distributed_optimizer"]):
        raise CheckpointLayoutError(
            f"the checkpoint was saved with use_distributed_optimizer={saved['use_distributed_optimizer']} and this "
            f"engine has {here['use_distributed_optimizer']}: switching the optimizer kind on resume is not supported "
            f"(the two store different master-weight tensors); resume with the saved setting (TP/PP/VPP/CP/DP may change)")
    saved_dtype = saved.get("params_dtype", "float32")  # checkpoints before bf16 existed are fp32
    if here["with_optimizer"] and saved["with_optimizer"] and saved_dtype != here["params_dtype"]:
        raise CheckpointLayoutError(
            f"the checkpoint was saved with megatron.dtype={saved_dtype} and this engine has {here['params_dtype']}: "
            f"switching precision on resume is not supported (bf16 keeps fp32 main params in the optimizer state, "
            f"fp32 keeps none); resume with the saved dtype, or export the weights (python -m "
            f"verl_lite.trainer.export) and start a new run from them")
    saved_ep, here_ep = saved["layout"].get("ep", 1), here["layout"]["ep"]
    if saved_ep != here_ep:
        raise CheckpointLayoutError(
            f"the checkpoint was saved with expert_model_parallel_size={saved_ep} and this engine has {here_ep}: "
            f"resharding a mixture-of-experts checkpoint to another EP size is not supported (megatron keeps the "
            f"experts' optimizer state in an optimizer of its own only when EP > 1, and an EP change misplaces "
            f"weights); resume with expert_model_parallel_size={saved_ep} (TP/PP/CP/DP may change), or export the "
            f"weights in the saved layout (python -m verl_lite.trainer.export) and start a new run from them")
    saved_apart = saved.get("expert_optimizer", saved_ep > 1)
    if here["with_optimizer"] and saved["with_optimizer"] and saved_apart != here["expert_optimizer"]:
        kept = {True: "in an optimizer of their own", False: "with the dense weights"}
        raise CheckpointLayoutError(
            f"the checkpoint keeps the experts' optimizer state {kept[saved_apart]} (saved at tensor_model_parallel_size="
            f"{saved['layout']['tp']}, expert_model_parallel_size={saved_ep}) and this engine keeps it "
            f"{kept[here['expert_optimizer']]}: experts are reduced apart when EP > 1, or when TP > 1 at EP = 1 (each TP "
            f"rank routes its own tokens); resume with the saved tensor_model_parallel_size={saved['layout']['tp']} and "
            f"expert_model_parallel_size={saved_ep}, or export the weights in the saved layout (python -m "
            f"verl_lite.trainer.export) and start a new run from them")
    if here["with_optimizer"] and not saved["with_optimizer"]:
        raise CheckpointLayoutError("the checkpoint holds no optimizer state (saved by a forward-only engine) but "
                                    "this engine trains; load the weights with load_hf or save from a trainable engine")


def load_engine_state(engine, directory: str | Path) -> dict:
    """Load a :func:`save_engine_state` checkpoint at this engine's (possibly different) layout. Collective.
    Returns the saver's description, with the ``lr_schedule`` the engine continues with when it trains."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import CheckpointingException

    directory = Path(directory)
    saved = check_dist_dir(directory)
    check_compatible(engine, saved)
    with_optimizer = engine.optimizer is not None
    state = _engine_sharded_state_dict(engine, is_loading=True, with_optimizer=with_optimizer)
    _reject_sharded_objects(state)
    try:
        with restricted_metadata_unpickling():
            loaded = dist_checkpointing.load(state, str(directory), sharded_strategy=None,
                                             common_strategy=_safe_common_strategy(),
                                             strict="raise_all" if with_optimizer else "assume_ok_unexpected")
    except CheckpointingException as err:
        raise CheckpointLayoutError(f"{directory}: dist_checkpointing could not map the saved tensors onto this "
                                    f"engine: {err}") from err
    _load_model_state(engine.chunks, loaded)
    if with_optimizer:
        with megatron_internals.torch_adam_step_fix(engine.optimizer):
            engine.optimizer.load_state_dict(loaded["optimizer"])
        megatron_internals.unshare_adam_steps(engine.optimizer)
        megatron_internals.use_fused_adam(engine.optimizer)
        saved = {**saved, "lr_schedule": engine.load_scheduler_state(loaded["scheduler"])}  # step count always
    _barrier()
    return saved


# ---------------------------------------------------------------------------- a role's directory
# <path>/dist/            dist_checkpointing shards (save_engine_state)
# <path>/rng/rank_K.safetensors   this rank's torch RNG state(s)
# <path>/hf_config/       config.json (+ tokenizer files): what an offline export needs besides the shards
def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        out["torch_cuda"] = torch.cuda.get_rng_state()
        for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
            out[f"tracker/{name}"] = state
    return out


def _restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available() and "torch_cuda" in tensors:
        from megatron.core import tensor_parallel

        torch.cuda.set_rng_state(tensors["torch_cuda"])
        tracker = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("tracker/")}
        if tracker:
            tensor_parallel.get_cuda_rng_tracker().set_states(tracker)


def save_role_state(engine, path: str | Path, tokenizer_path: str | None = None) -> None:
    """Engine state + this rank's RNG + the HF config/tokenizer into ``path`` (collective)."""
    from safetensors.torch import save_file

    path = Path(path)
    save_engine_state(engine, path / "dist")
    (path / "rng").mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in _rng_tensors().items()}, str(path / "rng" / f"rank_{_rank()}.safetensors"),
              metadata={"world_size": str(_world()), "layout": json.dumps(_describe(engine)["layout"])})
    if _rank() == 0:
        write_hf_config(engine.hf_config, path / "hf_config", tokenizer_path)
        if engine.cfg.lora is not None:
            (path / LORA_FILE).write_text(json.dumps(dataclasses.asdict(engine.cfg.lora)) + "\n")
    _barrier()


def load_role_state(engine, path: str | Path) -> dict:
    """Load :func:`save_role_state` output (any layout). RNG states are restored only when the saver had
    the same world size and layout (per-rank streams have no meaning in another layout); the result says
    ``{"layout": saved layout, "rng_restored": bool, "lr_schedule": the schedule in use (None forward-only)}``."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(path)
    saved = load_engine_state(engine, path / "dist")
    rng_file = path / "rng" / f"rank_{_rank()}.safetensors"
    same = False
    if rng_file.is_file():
        safe_files.check_safetensors(path, rng_file.relative_to(path))
        with safe_open(str(rng_file), "pt") as f:
            meta = f.metadata() or {}
        same = meta.get("world_size") == str(_world()) and json.loads(meta.get("layout", "{}")) == _describe(engine)["layout"]
    flags = [same] * _world()
    if torch.distributed.is_initialized():
        torch.distributed.all_gather_object(flags, same)  # plain bools
    restored = all(flags)
    if restored:
        _restore_rng(load_file(str(rng_file)))
    return {"layout": saved["layout"], "rng_restored": restored, "lr_schedule": saved.get("lr_schedule")}


def write_hf_config(hf_config, directory: str | Path, tokenizer_path: str | None) -> None:
    """config.json (+ generation config, tokenizer files) of the model into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(directory))
    if tokenizer_path:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(str(directory))
        gen = Path(tokenizer_path) / "generation_config.json"
        if gen.is_file():
            (directory / gen.name).write_bytes(gen.read_bytes())


def save_hf_pretrained(engine_or_chunks, hf_config, directory: str | Path, tokenizer_path: str | None = None) -> None:
    """The model as an HF directory (``model.safetensors`` + config + tokenizer) from an engine, chunks or a dict
    of full HF tensors; an engine with LoRA writes the merged model and its PEFT adapter in ``lora_adapter/``.
    Collective; rank 0 writes."""
    from safetensors.torch import save_file

    lora = None
    if hasattr(engine_or_chunks, "export_merged_hf"):  # an engine: a bf16 one exports its fp32 main params
        stream = engine_or_chunks.export_merged_hf()  # with LoRA: the adapters merged into the base
        lora = engine_or_chunks.cfg.lora
    elif isinstance(engine_or_chunks, dict):  # full HF tensors already exported (e.g. a merged LoRA model)
        stream = engine_or_chunks.items()
    else:
        stream = export_hf(engine_or_chunks, hf_config)
    # every rank iterates the (collective) stream to its end; rank 0 keeps the tensors
    tensors = {name: t.detach().to("cpu").contiguous().clone() for name, t in stream if _rank() == 0}
    if _rank() == 0:
        directory = Path(directory)
        write_hf_config(hf_config, directory, tokenizer_path)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    if lora is not None:  # and the adapter itself, in PEFT's format, next to the merged model
        save_lora_adapter(engine_or_chunks.chunks, lora, Path(directory) / LORA_ADAPTER_DIR,
                          base_model_path=getattr(engine_or_chunks.cfg, "model_path", None))
    _barrier()


LORA_ADAPTER_DIR = "lora_adapter"  # <hf export>/lora_adapter: adapter_config.json + adapter_model.safetensors
LORA_FILE = "lora.json"  # <role checkpoint>/lora.json: the engine's LoraConfig fields (rebuilds the adapters)


def save_lora_adapter(chunks, lora, directory, base_model_path=None) -> None:
    """The chunks' adapters as a PEFT adapter directory (``peft.PeftModel.from_pretrained(base, directory)``).
    Collective (the factors are gathered); rank 0 writes."""
    state = export_adapter_state(chunks)
    if _rank() == 0:
        save_peft_adapter(directory, lora, state, base_model_path=base_model_path)


def load_model_only(chunks, directory: str | Path) -> None:
    """Load just the model weights of an engine checkpoint (``<role>/dist``) into ``chunks`` (any layout);
    the optimizer state in the checkpoint is not read. Collective."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    check_dist_dir(directory)
    with restricted_metadata_unpickling():
        loaded = dist_checkpointing.load(_model_sharded_state_dict(chunks), str(directory),
                                         common_strategy=_safe_common_strategy(),
                                         strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    _load_model_state(chunks, loaded)
