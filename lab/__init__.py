"""fedsparse.lab: operator tooling (CLI, launchers, relay, sweeps, reports).

Nothing here runs inside a Flower app; ``fedsparse.server`` and ``fedsparse.client`` are the apps.
"""
