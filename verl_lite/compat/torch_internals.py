"""torch internals verl_lite relies on, for the torch versions in ``compat.TESTED_VERSIONS``.

- :func:`torch_function_disabled`: a block in which no ``__torch_function__`` override runs (no
  ``TorchFunctionMode``, such as the CPU adapter's, and no tensor subclass's), through torch's private
  ``torch._C.DisableTorchFunction``; torch has no public switch for it.
"""

from __future__ import annotations

import torch

from verl_lite.compat import require

require("torch", "verl_lite.compat.torch_internals")


def torch_function_disabled():
    """A context manager within which torch runs every call without ``__torch_function__`` dispatch: every
    torch-function mode (e.g. ``compat.cpu_adapter``'s, entered for the whole process) and subclass override
    is skipped."""
    return torch._C.DisableTorchFunction()
