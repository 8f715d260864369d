"""Starting real processes: Flower's environment (``flower``), the launch skeleton
(``base``), ``simulate``, loopback ``deploy``, ``compose`` files, TLS, child processes,
network shaping (``netns``), the byte-counting ``relay`` and the ``wire`` report.
"""
