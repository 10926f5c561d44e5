"""Every public dataclass of verl_lite has a name of its own: a Python user cannot import the wrong one."""

import dataclasses
import importlib
import inspect
import pkgutil
from collections import defaultdict

import verl_lite


def test_no_two_public_dataclasses_share_a_name():
    owners = defaultdict(set)
    for info in pkgutil.walk_packages(verl_lite.__path__, "verl_lite."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional backend (vllm, ...) not installed here
            continue
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and dataclasses.is_dataclass(obj) and not name.startswith("_")
                    and obj.__module__.startswith("verl_lite.")):
                owners[name].add(obj.__module__)
    assert owners, "no dataclass found: the walk is broken"
    shared = {name: sorted(mods) for name, mods in owners.items() if len(mods) > 1}
    assert not shared, f"class names defined in more than one module: {shared}"
