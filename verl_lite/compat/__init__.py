"""Everything verl_lite does to another library's internals, in one place, pinned.

Each module here reaches into a private API or patches behaviour of one library version, and
calls :func:`require` when it is imported, so a different installed version fails at once, with
one line naming the package and the version the shim was written for, instead of failing (or
silently misbehaving) somewhere deep in a run. ``pyproject.toml`` pins the same versions
(``tests/test_packaging.py`` checks that the two agree).

- :mod:`.cpu_adapter`: megatron-core on a CPU-only torch (CUDA device queries, synchronize,
  hard-coded ``device="cuda"``).
- :mod:`.lazy_compile`: importing megatron-core / tensordict without their import-time
  ``torch.compile`` preparation and wandb.
- :mod:`.megatron_internals`: megatron-core's expert-DP gloo groups without a timeout, the MoE
  alltoall dispatcher's CUDA streams on a CPU-only torch, the distributed optimizer's Adam
  ``step`` on load, torch's fused Adam kernel for megatron's torch AdamW, megatron's dense MLPs re-classed as
  the engine's ``SwiGLUMLP``, megatron's unfused RoPE routed through the engine's.
- :mod:`.ray_local`: Ray's private node hooks for a loopback-only, minimal local Ray.
- :mod:`.fast_exit`: CPython's ``atexit._run_exitfuncs``, to end the CLI without the interpreter's
  teardown (falls back to ``sys.exit`` where it is missing).
- :mod:`.kv_cache`: a KV cache layer on transformers' ``DynamicLayer`` whose decode steps write in
  place instead of ``torch.cat`` (stands aside, like ``transformers_imports``, with any transformers
  but the version it was written for, and for models with other than full-attention layers).
- :mod:`.hf_attention`: the HF rollout's decode-step attention as matmuls, registered with transformers'
  ``AttentionInterface`` (stands aside with any transformers but the version it was written for, and for a
  model transformers does not run on ``sdpa``).
- :mod:`.transformers_imports`: transformers' lazy-import table (``define_import_structure``) read
  from a cache file instead of a scan of ~3,300 source files in every process. A speed-up only: with
  any transformers but the version it was written for, it stands aside (no ``require``).
"""

from __future__ import annotations

from importlib import metadata

from verl_lite.errors import BadInput

# The versions each shim was written and tested for (pyproject.toml pins the same).
TESTED_VERSIONS = {"megatron-core": "0.16.1", "ray": "2.60.0"}


class IncompatibleVersion(BadInput):
    """An installed library is not the version a verl_lite shim was written for."""


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def require(package: str, shim: str) -> None:
    """Raise :class:`IncompatibleVersion` unless ``package`` is installed at its tested version."""
    tested = TESTED_VERSIONS[package]
    found = installed_version(package)
    if found != tested:
        raise IncompatibleVersion(
            f"{shim} was written for {package}=={tested}, but {package} {found or '(not installed)'} is installed",
            f"install the tested version: pip install '{package}=={tested}'",
        )
