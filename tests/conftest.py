"""Suite-wide hypothesis profiles: deterministic by default, random on request.

``ci`` (the default) derandomizes every property test: the examples are a fixed function of the
test, so a run passes or fails the same way on every machine and every retry, and no example
database carries state between runs. ``dev`` draws fresh random examples (and remembers
failures in ``.hypothesis/``) to hunt for edge cases; run it before trusting a changed oracle::

    HYPOTHESIS_PROFILE=dev pytest tests/common/wire/payload/

A failure under ``dev`` prints a ``@reproduce_failure`` blob to pin the case in the test.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", derandomize=False, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
