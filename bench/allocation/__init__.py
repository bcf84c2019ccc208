"""The allocation policies at paper scale, without a model, with the goals of issue #15.

`python -m bench.allocation` runs `__main__.py`, which runs `study.py`; the map of the other modules is in
bench/__init__.py."""
