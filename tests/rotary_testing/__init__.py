"""Helpers shared by the Python test suites (tests/python, tests/fuzz, tests/docs):
the independent float64 reference (reference.py), input builders and
tolerances (rope_testing.py), the KV-cache cases (kv_testing.py) and the
DTensor scenarios. On the path through pytest's ``pythonpath`` (pyproject.toml)."""
