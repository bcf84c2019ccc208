"""The components' speed against plain baselines, in one table of ratios.

`python -m bench.throughput` runs `__main__.py`, which runs `study.py`; the map of the other modules is in
bench/__init__.py."""
