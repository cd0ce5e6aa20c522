"""A seeded, bounded fuzzer over every public entry point of rotary.

``PYTHONPATH=python:tests python -m fuzz.run --cases N --seed S`` runs cases S .. S+N-1 in
child processes (a crash names its case), checks each accepted call against
the float64 reference (tests/rotary_testing/reference.py), checks that refused calls
leave every input byte and module state unchanged, and prints counts per
category. tests/python/test_fuzz_smoke.py runs a fixed slice of it.
"""
