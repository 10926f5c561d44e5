"""Names inside Ray's private modules that verl_lite refers to as strings, for the Ray in ``compat.TESTED_VERSIONS``.

Nothing here imports Ray: the driver sets up its console (``utils/quiet.py``) before Ray is imported. With
another Ray a name may match nothing, and what uses it (a log filter) stands aside.
"""

from __future__ import annotations

# the logger of Ray's "Token authentication is enabled for this Ray cluster" notice at ray.init
TOKEN_SETUP_LOGGER = "ray._private.authentication.authentication_token_setup"
