"""Test helpers shipped with the package (importable by the test suites of third-party store
backends and weight-transfer families).

The suites' plain ``assert`` statements get pytest's assertion messages (the values compared)
when they fail in a backend author's test run: pytest rewrites only test modules unless told.
"""

try:
    import pytest
except ImportError:  # the suites need pytest; importing this package alone does not
    pass
else:
    pytest.register_assert_rewrite(
        "nemo_dataplane.testing.conformance",
        "nemo_dataplane.testing.claim_conformance",
        "nemo_dataplane.testing.scale_conformance",
        "nemo_dataplane.testing.lifecycle_conformance",
        "nemo_dataplane.testing.weight_transfer_conformance",
    )
