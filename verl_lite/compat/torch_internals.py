"""torch's private switch that turns every ``__torch_function__`` override off, for the torch versions in
``compat.TESTED_VERSIONS`` (torch has no public one)."""

from __future__ import annotations

import torch

from verl_lite.compat import require

require("torch", "verl_lite.compat.torch_internals")


def torch_function_disabled():
    """A context manager within which no ``__torch_function__`` override runs (no torch-function mode, such as
    ``compat.cpu_adapter``'s, and no tensor subclass's), through ``torch._C.DisableTorchFunction``."""
    return torch._C.DisableTorchFunction()
