"""Benchmarks: each module is a script (``python -m bench.<name> --help`` or ``python bench/<name>.py``).

Shared helpers live in :mod:`bench.common`; results go to ``bench/results/``. ``make bench`` runs a quick
subset, ``make bench-all`` every benchmark at its measured settings (see the Makefile).
"""
