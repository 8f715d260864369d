"""fedsparse.client."""
