"""Runs and their statistics: centralized ``train``, ``sweep`` grids (``sweep_plan``, each run
on its backend: ``sweep_backends``) and their ``tuning``, the ``report``, ``stats``,
accuracy-against-time (``timing``) and model ``export``.
"""
