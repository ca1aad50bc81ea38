"""Test helpers shipped with the package (importable by third-party backends' test suites)."""
