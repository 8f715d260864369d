"""What travels: the sparse update codec (``payload/``), the round's typed messages
(``protocol``) and the run-log schema (``run_log``).
"""
