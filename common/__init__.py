"""fedsparse.common."""
