"""What an HF model directory must hold for the engine to load it, checked from its files (config.json and
the safetensors headers; no tensor is read) before anything reads the model. An HF hub id is resolved to
its snapshot directory in the HF cache (:func:`resolve_model_dir`). Each ``*_problems`` function takes
``key`` (the caller's name of the model path) and returns one line per problem, naming the file and the fix.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from verl_lite.engine import lora as engine_lora
from verl_lite.engine.hf_bridge import hf_shapes, weight_files
from verl_lite.engine.config import lora_projections
from verl_lite.utils.safe_files import read_safetensors_header

VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")  # [vocab_size, hidden] in an HF causal LM


HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]  # what the engine reads


def looks_like_hub_id(path: str | None) -> bool:
    """Not an existing local path, and a valid HF hub repository id (``name`` or ``org/name``)."""
    if not path or Path(path).expanduser().exists():
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return True


def _hub_env() -> tuple:
    """(offline?, cache dir, endpoint): what huggingface_hub read from HF_HUB_OFFLINE / HF_HUB_CACHE / HF_ENDPOINT."""
    from huggingface_hub import constants

    return constants.is_offline_mode(), constants.HF_HUB_CACHE, constants.ENDPOINT


PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def _endpoint_reachable(endpoint: str, timeout_s: float = 3.0) -> bool:
    """Whether a TCP connection to the hub's host opens within ``timeout_s`` (a failed name lookup fails at
    once). Behind a proxy (``HTTPS_PROXY`` / ``ALL_PROXY``) the hub client's own requests decide: True."""
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(name) for name in PROXY_VARIABLES):
        return True
    url = urlsplit(endpoint)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout_s):
            return True
    except OSError:
        return False


def _not_fetchable(offline: bool) -> str:
    """Why a hub id that is not in the HF cache cannot be fetched."""
    why = "HF_HUB_OFFLINE is set" if offline else "there is no network"
    return f"is neither a local directory nor in the HF cache, and {why}, so it cannot be downloaded"


@functools.lru_cache(maxsize=None)
def _hub_snapshot(repo_id: str, env: tuple) -> tuple[str | None, str | None]:
    """(snapshot directory, None) or (None, why not): ``huggingface_hub.snapshot_download`` of the model's files
    into the HF cache (downloaded once; a cached snapshot is used offline). ``env``: the cache key."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return snapshot_download(repo_id, allow_patterns=HUB_FILES, local_files_only=True), None  # cached: no request
    except LocalEntryNotFoundError:
        if env[0]:
            return None, _not_fetchable(offline=True)
    except Exception:  # noqa: BLE001 - an unreadable cache entry: let the download below say what is wrong
        pass
    if not _endpoint_reachable(env[2]):  # the hub client would retry with back-off for about a minute first
        return None, _not_fetchable(offline=False)
    try:
        return snapshot_download(repo_id, allow_patterns=HUB_FILES), None
    except GatedRepoError:
        return None, "is a gated model on the Hugging Face hub: accept its terms there and log in (hf auth login)"
    except RepositoryNotFoundError:
        return None, "is neither a local directory nor a model on the Hugging Face hub"
    except LocalEntryNotFoundError:
        return None, _not_fetchable(offline=env[0])
    except Exception as e:  # noqa: BLE001 - anything else the hub client raises
        return None, f"could not be fetched from the Hugging Face hub ({type(e).__name__}: {e})"


def resolve_model_dir(path: str) -> str:
    """``path`` itself when it is a local path (or not a hub id); an HF hub id -> its snapshot directory in the
    HF cache (verl resolves ``model.path`` the same way). When the hub id cannot be fetched, the id itself:
    :func:`model_dir_problem` then says why."""
    if not looks_like_hub_id(path):
        return path
    local, _ = _hub_snapshot(path, _hub_env())
    return local or path


def model_dir_problem(key: str, path: str | None, null_means: str = "the shipped tiny model") -> str | None:
    """One line when ``path`` is no HF model directory (no config.json): for a hub id, why it was not fetched
    and how to pass a local directory instead; ``null_means``: what the key's null stands for."""
    if path and (Path(path) / "config.json").is_file():
        return None
    why = _hub_snapshot(path, _hub_env())[1] if looks_like_hub_id(path) else None
    if why:
        return (f"{key}={path!r} {why}; download it where there is network (hf download {path} --local-dir DIR) "
                f"and pass the local directory: {key}=DIR")
    return (f"{key}={path!r} is not an HF model directory (no config.json); give a local HF model dir, "
            f"an HF hub id, or null for {null_means}")


def read_config(model_path: str | None) -> dict | None:
    """``<model_path>/config.json`` as a dict; None when it is missing or does not parse."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    return cfg if isinstance(cfg, dict) else None


def config_int(model_path: str | None, name: str) -> int | None:
    """A positive integer field of config.json (vocab_size, max_position_embeddings); None when it is not one."""
    value = (read_config(model_path) or {}).get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def model_config_problems(key: str, model_path: str | None) -> list[str]:
    """Problems with ``<model_path>/config.json``: unreadable, not JSON, not an object, no architecture fields."""
    if not model_path:
        return []
    file = Path(model_path) / "config.json"
    if not file.is_file():
        return []  # validate_config reports the missing directory / file
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as e:
        return [f"{key}={model_path!r}: {file} cannot be read ({e}); fix its permissions or re-export the model"]
    except ValueError as e:
        return [f"{key}={model_path!r}: {file} is not valid JSON ({e}); fix the file or re-export the model"]
    if not isinstance(cfg, dict):
        return [f"{key}={model_path!r}: {file} holds a {type(cfg).__name__}, not a JSON object; re-export the model"]
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") if k not in cfg]
    if missing:
        return [f"{key}={model_path!r}: {file} lacks {missing}; give a complete HF causal-LM config.json"]
    return []


def safetensors_header(file: Path) -> dict:
    """The JSON header of a ``.safetensors`` file: tensor name -> {dtype, shape, data_offsets}
    (``safe_files.read_safetensors_header``, a symbolic link followed: the HF cache's snapshots are links);
    ValueError / OSError when it is not one."""
    with open(file, "rb") as f:
        return read_safetensors_header(f)[0]


# what a model's output layer is, by the engine that loads it: "lm" (lm_head, or tied to the embedding),
# "value" (a critic: score.weight when the checkpoint has one, else a fresh head), "reward" (score.weight required)
HEADS = ("lm", "value", "reward")


def model_weight_problems(key: str, model_path: str | None, head: str = "lm") -> list[str]:
    """The weights of ``<model_path>`` (from the safetensors headers) against its config.json, as the engine's
    loader would find them: there are weight files, the vocabulary tensors have ``vocab_size`` rows, and
    :func:`weight_shape_problems`. ``head``: one of ``HEADS``."""
    vocab = config_int(model_path, "vocab_size")
    if vocab is None:
        return []  # model_config_problems reports a broken config.json
    try:
        files = weight_files(Path(model_path))
    except (OSError, ValueError, AttributeError) as e:
        return [f"{key}={model_path!r}: model.safetensors.index.json cannot be read ({e}); re-export the model"]
    if not files:
        return [f"{key}={model_path!r} holds no weights (no *.safetensors next to its config.json); save the model "
                f"with save_pretrained(safe_serialization=True) into that directory"]
    problems, headers = [], {}
    for file in files:
        try:
            header = safetensors_header(file)
        except (OSError, ValueError) as e:
            problems.append(f"{key}={model_path!r}: {file} cannot be read as safetensors ({e}); re-export the model")
            continue
        headers[file] = header
        for name in VOCAB_TENSORS:
            shape = _shape_of(header.get(name))
            if shape and shape[0] != vocab:
                problems.append(
                    f"{key}={model_path!r}: {file} holds {name} of shape {list(shape)} but config.json's "
                    f"vocab_size is {vocab}; set vocab_size to {shape[0]} in {Path(model_path) / 'config.json'} "
                    f"(or re-export the model)")
    return problems or weight_shape_problems(key, model_path, headers, head)


def _shape_of(entry) -> list | None:
    shape = entry.get("shape") if isinstance(entry, dict) else None
    return list(shape) if isinstance(shape, list) else None


def weight_shape_problems(key: str, model_path: str, headers: dict, head: str = "lm") -> list[str]:
    """The tensors the engine loads (``hf_bridge.hf_shapes`` of config.json) against the safetensors ``headers``
    (file -> header): each must exist with its shape (a critic's ``score.weight`` may be absent), and no layer
    lies beyond ``num_hidden_layers`` (the loader would drop it silently). One line for the first difference."""
    config = read_config(model_path) or {}
    try:
        expected = hf_shapes(config, value_head=head != "lm")
    except (TypeError, ValueError, KeyError, ZeroDivisionError):
        return []  # a config.json the engine cannot read either: model_config_problems' and the loader's
    where, found = {}, {}
    for file, header in headers.items():
        for name, entry in header.items():
            where[name], found[name] = file, _shape_of(entry)
    cfg_file = Path(model_path) / "config.json"
    optional = {"score.weight"} if head == "value" else set()
    wrong = [(name, list(shape), found.get(name)) for name, shape in expected.items() if name not in VOCAB_TENSORS
             and name not in optional and found.get(name) != list(shape)]
    layers = config.get("num_hidden_layers")
    beyond = sorted({int(n.split(".")[2]) for n in found if n.startswith("model.layers.") and
                     n.split(".")[2].isdigit() and isinstance(layers, int) and int(n.split(".")[2]) >= layers})
    out = []
    if beyond:
        out.append(f"{key}={model_path!r}: the weights hold {max(beyond) + 1} layers but {cfg_file} says "
                   f"num_hidden_layers={layers}: config.json describes a smaller model than its weights; set "
                   f"num_hidden_layers={max(beyond) + 1} there (or re-export the model)")
    if wrong:
        name, shape, got = wrong[0]
        more = f" (and {len(wrong) - 1} more tensors differ)" if len(wrong) > 1 else ""
        fields = {k: config.get(k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim") if k in config}
        state = (f"{where[name]} holds {name} of shape {got}" if got is not None else
                 f"the weights lack {name}" + (" (the reward model's score head)" if name == "score.weight" else ""))
        out.append(f"{key}={model_path!r}: {state} but {cfg_file} ({fields}) implies {shape}{more}: the weights do "
                   f"not match config.json; fix config.json or re-export the model")
    return out


def tokenizer_id_problems(tok: tuple[str, str], tokenizer, models: list[tuple[str, str]]) -> list[str]:
    """Every id the tokenizer can produce (its vocabulary and added tokens) must have an embedding row in each
    model (``vocab_size`` of its config.json). ``tok`` = (key, path) of the tokenizer, ``models`` = (key, path)."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return []
    ids = list(tokenizer.get_vocab().values())
    if not ids:
        return []
    top, (tok_key, tok_path) = max(ids), tok
    problems = []
    for key, path in models:
        vocab = config_int(path, "vocab_size")
        if vocab is not None and top >= vocab:
            model = "the model's config.json" if (key, path) == tok else f"{key}={path!r}"
            problems.append(
                f"{tok_key}={tok_path!r}: the tokenizer produces ids up to {top} ({len(ids)} tokens) but {model} "
                f"has vocab_size {vocab}: ids >= {vocab} have no embedding row; give the tokenizer the model was "
                f"trained with ({tok_key.rsplit('.', 1)[0]}.tokenizer_path), or a model with at least {top + 1} "
                f"vocabulary rows")
    return problems


ADAPTER_CONFIG_MAX_BYTES = 1_000_000  # an adapter_config.json is a few hundred bytes


def lora_adapter_problems(key: str, lora) -> list[str]:
    """``<key>.adapter_path`` is a PEFT adapter directory of plain LoRA with the section's rank, alpha and
    target projections (``engine.lora``'s own checks, as the workers apply them)."""
    path = lora.adapter_path
    if not path:
        return []
    where = f"{key}.adapter_path={path!r}"
    d = Path(path).expanduser()
    if not d.is_dir():
        return [f"{where} does not exist or is not a directory; give a PEFT adapter directory "
                f"({engine_lora.ADAPTER_CONFIG} + {engine_lora.ADAPTER_WEIGHTS}) or null for fresh adapters"]
    missing = [f for f in (engine_lora.ADAPTER_CONFIG, engine_lora.ADAPTER_WEIGHTS) if not (d / f).is_file()]
    if missing:
        return [f"{where} lacks {missing}: not a PEFT adapter directory; give the directory PEFT's save_pretrained "
                f"wrote (or null for fresh adapters)"]
    file = d / engine_lora.ADAPTER_CONFIG
    try:
        if file.stat().st_size > ADAPTER_CONFIG_MAX_BYTES:
            raise ValueError(f"{file.stat().st_size} bytes, more than an adapter config holds")
        config = json.loads(file.read_text())
        if not isinstance(config, dict):
            raise ValueError(f"a JSON {type(config).__name__}, not an object")
    except (OSError, ValueError) as e:
        return [f"{where}: {file} cannot be read ({e}); give a PEFT adapter directory"]
    from types import SimpleNamespace

    engine_cfg = SimpleNamespace(rank=lora.rank, alpha=lora.alpha,  # what check_adapter_matches reads
                                 projections=lora_projections(lora.target_modules, lora.exclude_modules))
    try:
        engine_lora.check_plain_lora(config, file)
        engine_lora.check_adapter_matches(engine_cfg, config, str(path))
    except ValueError as e:
        return [f"{where}: {str(e).removeprefix(f'lora.adapter_path={str(path)!r} ')}; set {key}.rank/alpha/"
                f"target_modules to the adapter's, or give an adapter trained with these settings"]
    return []
