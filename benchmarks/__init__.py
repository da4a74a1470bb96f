"""The celery-caps benchmark suite; run it with ``python benchmarks/run.py`` (see README.md here)."""
