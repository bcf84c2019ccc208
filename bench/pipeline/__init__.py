"""The pipeline's steps per second at staleness 0, 1, 2 against the round-synchronous reference.

`python -m bench.pipeline` runs `__main__.py`, which runs `study.py`; the map of the other modules is in
bench/__init__.py."""
