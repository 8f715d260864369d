"""fedsparse.common: the math, no Flower and no gRPC.

Grouped by concept: ``dp/`` (the DP-SGD optimizer, the per-sample engines, accounting),
``methods/`` (the sparsification methods, their masks and schedules), ``aggregation/``,
``wire/`` (payload codec, protocol, run log), ``data/``, ``models/``, ``training/``; beside them
the helpers every concept shares (``config``, ``coerce``, ``seeds``, ``layout``, ``plugins``,
``atomic``, ``known_warnings``).
"""
