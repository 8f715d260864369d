"""A federation from Python (``simulate``, in ``api``), and the grids that run the real
ClientApp without a SuperLink: in this process (``inprocess``) or on Ray workers (``raygrid``;
the workers and the cluster: ``rayworkers``), and the allocator setting they share
(``memory``).

``from fedsparse.lab.simulation import simulate`` loads nothing heavy: torch, Flower and Ray
load when a run starts.
"""

from fedsparse.lab.simulation.api import simulate

__all__ = ["simulate"]
