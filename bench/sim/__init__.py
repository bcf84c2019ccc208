"""The paper-scale simulation shared by `bench.sampling`, `bench.allocation` and `bench.table2`: no model, no GPU,
the real `pipeline.buffer.Scheduler` driven by simulated engines in simulated time (map in bench/__init__.py)."""
