"""``python -m fedsparse.lab.cli``: the ``fedsparse`` command."""

from fedsparse.lab.cli import main

main()
