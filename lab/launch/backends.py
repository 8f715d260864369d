"""The backend vocabulary: where the clients of a run live, one set of names for every command.

``fedsparse simulate`` and ``fedsparse sweep`` both take ``--backend`` from ``BACKENDS``:
``flower`` (Flower's simulation engine), ``inprocess`` (``InProcessGrid``: the clients in the
server's process), ``deploy`` (a loopback deployment of a SuperLink and SuperNodes) and ``ray``
(``RayGrid``: many virtual clients per Ray worker). Older spellings stay accepted through
``BACKEND_ALIASES`` (``simulation``: the sweep's old name of Flower's engine). Nothing to
import here but the names, so the command line's help reads them at no cost.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["BACKENDS", "BACKEND_ALIASES", "BACKEND_HELP", "Backend", "backend_name"]

#: Where the clients of a run live (see this module's docstring).
Backend = Literal["flower", "inprocess", "deploy", "ray"]
BACKENDS: tuple[Backend, ...] = ("flower", "inprocess", "deploy", "ray")
#: Older names of backends, accepted wherever a backend is named.
BACKEND_ALIASES: dict[str, Backend] = {"simulation": "flower"}
#: The backends as the commands' ``--backend`` help names them.
BACKEND_HELP = "flower (alias simulation): Flower's engine | inprocess | deploy | ray"


def backend_name(name: str) -> str:
    """``name`` with an older spelling replaced by its ``BACKENDS`` name (others unchanged)."""
    return BACKEND_ALIASES.get(name, name)
