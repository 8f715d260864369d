"""fedsparse.lab: the operator's side, grouped by role.

``cli/`` (the ``fedsparse`` command, one module per command), ``launch/`` (real processes:
simulate, loopback deploy, compose files, TLS, network shaping, the byte-counting relay),
``simulation/`` (grids that call the real ClientApp without a SuperLink: in process, or on
Ray), ``experiments/`` (train, sweep, tuning, reports, statistics) and ``research/`` (the RS
paper's reproduction, the gradient-inversion study). ``fedsparse.server`` and
``fedsparse.client`` are the Flower apps; lab starts them, or, in ``simulation/``, calls the
ClientApp directly.
"""
