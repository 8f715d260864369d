"""fedsparse.server."""
