"""The library chatter that ``fedsparse``'s commands silence while they run.

Its own module, free of heavy imports, so that the command line (``lab/cli``) and the
centralized runs (``lab/train.py``, ``lab/reproduce.py``) share one list without ``--help``
loading torch.
"""

from __future__ import annotations

__all__ = ["QUIET_WARNINGS"]

#: Opacus/torch chatter that says nothing about a run: seeded (non-secure) RNG is the
#: documented default, the RDP order warning is informational, and Opacus's hooks fire on
#: inputs that do not require grad by design. Ignored while a command runs (``fedsparse``'s
#: ``main``) and while the reproduction's centralized runs train.
QUIET_WARNINGS = (
    "Secure RNG turned off",
    "Optimal order is the largest alpha",
    "Full backward hook is firing",
)
