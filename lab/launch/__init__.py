"""Starting real processes: Flower's environment (``flower``), the launch skeleton
(``base``), ``simulate`` (on one of the ``backends``), loopback ``deploy``, ``compose`` files
(and ``compose_check``), TLS, child processes, network shaping (``netns``), the byte-counting
``relay`` and the ``wire`` report.
"""
