"""The stash key under which tests/conftest.py keeps every collected test file (tests/unit/test_collection.py)."""

import pytest

COLLECTED = pytest.StashKey[set]()
