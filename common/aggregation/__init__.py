"""Aggregation at the server: sparse-aware averaging (``sparse``) and the robust rules and
update-norm bounds used against hostile clients (``robust``).
"""
