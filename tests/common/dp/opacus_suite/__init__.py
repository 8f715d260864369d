"""Opacus's own tests of ``PrivacyEngine.make_private``, vendored from Opacus 1.6.0 (Apache-2.0).

``privacy_engine.py`` (the base test) and ``models.py`` (its sample models and cases) come from
the PyPI wheel ``opacus-1.6.0``, ``opacus/tests/privacy_engine_test.py`` and ``utils.py``; each
file's docstring lists what changed. The file names do not end in ``_test.py`` so that pytest
does not run them against Opacus itself: ``tests/common/dp/test_opacus_suite.py`` runs them
with the func and factored engines in place of ``PrivacyEngine``.
"""
