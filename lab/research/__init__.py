"""Studies of the RS paper's claims: its reproduction (``reproduction``), the
gradient-inversion study (``inversion``) and the server-side ``attacks``.
"""
