"""Grids that run the real ClientApp without a SuperLink: in this process (``inprocess``)
or on Ray workers (``raygrid``; the workers and the cluster: ``rayworkers``), and the allocator
setting they share (``memory``).
"""
