"""DP-SGD with sparsification: the optimizer (``optimizer``), the privacy engine (``engine``),
the modules that compute their own per-sample gradients (``per_sample``), the per-sample
engines (``engines/``), the mechanisms by trait (``mechanisms``), accounting
(``accounting``), user-level DP (``central``) and the clip/momentum scaling rule
(``scaling``). Import each from its module: the package re-exports nothing, so that its light
modules (``mechanisms``) load without torch.
"""
