"""jmp_lite's benchmark harness: ``python bench/run.py --help``."""
