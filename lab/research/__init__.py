"""Studies of the RS paper's claims: its reproduction (``reproduce``, ``reproduce_report``),
the gradient-inversion study (``inversion``) and the server-side ``attacks``.
"""
