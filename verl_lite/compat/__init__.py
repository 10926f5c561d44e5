"""Everything verl_lite does to another library's internals, in one place, pinned.

Each module here reaches into a private API or patches behaviour of one library version (its docstring says which),
behind small named functions; nothing outside this package touches another library's private names
(``tests/test_import_layers.py``), and it imports nothing of the engine's or the rollout's.

:data:`TESTED_VERSIONS` is the one table of the versions the shims were written and tested for. The packages of
:data:`PINNED` are required at those versions (their shims call :func:`require` when imported; ``pyproject.toml``
pins :func:`pinned_specifier`); the shims on any other package are speed-ups that stand aside with another version
(:func:`installed_is_tested`).
"""

from __future__ import annotations

from importlib import metadata

from verl_lite.errors import BadInput

# package -> the versions its shims were written and tested for: an exact release ("0.16.1"), or a
# release series ("2.13": every 2.13.x, any local build such as +cpu or +cu130)
TESTED_VERSIONS: dict[str, tuple[str, ...]] = {
    "megatron-core": ("0.16.1",),
    "ray": ("2.60.0",),
    "torch": ("2.11", "2.13"),  # 2.13: the CPU suite; 2.11: the GPU check (docs/gpu.md)
    "transformers": ("5.25.0",),
}
PINNED = ("megatron-core", "ray", "torch")  # refused at any other version (require); pyproject.toml pins them


class IncompatibleVersion(BadInput):
    """An installed library is not the version a verl_lite shim was written for."""


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def is_tested(package: str, version: str | None) -> bool:
    """Whether ``version`` of ``package`` is one :data:`TESTED_VERSIONS` names (a local build label such as
    ``+cpu`` is ignored; a series ``"2.13"`` takes every ``2.13.x``)."""
    if version is None:
        return False
    release = version.split("+", 1)[0]
    return any(release == tested or release.startswith(f"{tested}.") for tested in TESTED_VERSIONS[package])


def installed_is_tested(package: str) -> bool:
    """Whether the installed ``package`` is a tested version (reads the package metadata: call it once)."""
    return is_tested(package, installed_version(package))


def pinned_specifier(package: str) -> str:
    """The pip specifier admitting exactly the tested versions of ``package``: ``==X.Y.Z`` for one release, else
    the series of one major version with the untested ones between excluded (``>=2.11,!=2.12.*,<2.14``)."""
    tested = TESTED_VERSIONS[package]
    if len(tested) == 1 and tested[0].count(".") == 2:
        return f"=={tested[0]}"
    series = [tuple(int(part) for part in v.split(".")) for v in tested]
    if any(len(s) != 2 for s in series) or len({major for major, _ in series}) != 1:
        raise ValueError(f"TESTED_VERSIONS[{package!r}]={tested}: give one exact release or series X.Y of one major")
    major, minors = series[0][0], sorted(minor for _, minor in series)
    gaps = [f"!={major}.{m}.*" for m in range(minors[0] + 1, minors[-1]) if m not in minors]
    return ",".join([f">={major}.{minors[0]}", *gaps, f"<{major}.{minors[-1] + 1}"])


_REQUIRED_FOUND: set[str] = set()  # packages require() found at a tested version in this process


def require(package: str, shim: str) -> None:
    """Raise :class:`IncompatibleVersion` unless ``package`` is installed at a tested version (checked once per
    process and package)."""
    if package in _REQUIRED_FOUND:
        return
    found = installed_version(package)
    if not is_tested(package, found):
        wanted = f"{package}{pinned_specifier(package)}"
        raise IncompatibleVersion(
            f"{shim} was written for {wanted}, but {package} {found or '(not installed)'} is installed",
            f"install a tested version: pip install '{wanted}'",
        )
    _REQUIRED_FOUND.add(package)
