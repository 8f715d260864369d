"""Aggregation at the server: sparse-aware averaging (``sparse``) and the robust rules used
against hostile clients (``robust``) and the update-norm bounds (``norm_bounds``).
"""
