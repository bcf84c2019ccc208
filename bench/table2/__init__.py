"""The paper's Table 2 reproduced in a cost model, and this project's setups priced the same way.

`python -m bench.table2` runs `__main__.py`, which runs `study.py`; the map of the other modules is in
bench/__init__.py."""
