"""Learning on the tiny model: GRPO against Reinforce-Ada-pos and -balance, several seeds, real `train` runs.

`python -m bench.e2e` runs `__main__.py`, which runs `study.py`; the map of the other modules is in
bench/__init__.py."""
