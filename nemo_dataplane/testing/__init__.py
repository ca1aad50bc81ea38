"""Test helpers shipped with the package (importable by third-party backends' test suites).

The suites' plain ``assert`` statements get pytest's assertion messages (the values compared)
when they fail in a backend author's test run: pytest rewrites only test modules unless told.
"""

try:
    import pytest
except ImportError:  # the suites need pytest; importing this package alone does not
    pass
else:
    pytest.register_assert_rewrite("nemo_dataplane.testing.conformance", "nemo_dataplane.testing.claim_conformance")
