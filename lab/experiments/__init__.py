"""Runs and their statistics: centralized ``train``, ``sweep`` grids and their ``tuning``,
the ``report``, ``stats``, accuracy-against-time (``timing``) and model ``export``.
"""
