"""Benchmarks, by study. Each study has one entry point, `python -m bench.NAME`: a study of one file is `NAME.py`; a
study of several is a package `NAME/` whose `__main__.py` runs its `study.py`, the other files being its parts (some
of them processes the study starts, runnable alone as `python -m bench.NAME.PART`). Every result lands in
bench/results/, written through `output.py`; `make bench` (`run_all.py`) runs the everyday set.

Learning on a real model, against a real peer
- `peer_trl.py`: TRL's GRPOTrainer beside this project's GRPO, Ada-pos and Ada-balance on SmolLM2-135M-Instruct
  (same model, prompts, reward object, optimizer); held-out Ave@k against seconds and samples.
- `eval_noise.py`: how far one held-out evaluation moves with its sampling seeds alone (both evaluation paths).

Learning on the tiny model: `python -m bench.e2e` (`e2e/__main__.py`)
- `e2e/study.py`: the sweep (strategies x settings x seeds, real `train` runs), its statistics and report;
  `e2e/strategies.py` (what is compared, as data), `e2e/data.py` (its prompts), `e2e/runs.py` (one run, and what
  it measured), `e2e/evaluate.py` (held-out scores of the published versions, one engine; its own process, also used
  by peer_trl), `e2e/stats.py` (means, curves, paired differences), `e2e/report.py` (markdown and plots).

The paper-scale simulation, without a model (a library shared by sampling, allocation and table2; runs nothing)
- `sim/costmodel.py` (every constant, with its source), `sim/engine.py` (a continuous-batching engine whose step time
  grows with batch and context), `sim/run.py` (simulated engines and learner around the real Scheduler),
  `sim/population.py` (prompt pass rates over training, fitted to the paper's Fig. 5), `sim/trace.py` (a
  round-synchronous run, kept to be re-priced).

The paper's Table 2 in the cost model: `python -m bench.table2` (`table2/__main__.py`)
- `table2/study.py`: Table 2 reproduced, and this project's setups priced the same way; `table2/report.py` (markdown).

Sampling cost and allocation at paper scale
- `sampling.py`: samples and rounds per useful group for each exit rule and schedule.
- `python -m bench.allocation` (`allocation/__main__.py`): `allocation/study.py`, the allocation policies (uniform at
  M = 4, 8, 16, est, min_cost); `allocation/report.py` (its goals and markdown).

The pipeline's speed against plain baselines
- `python -m bench.pipeline` (`pipeline/__main__.py`): `pipeline/study.py`, steps per second at staleness 0, 1, 2
  against the round-synchronous reference; `pipeline/reference_buffer.py` (that reference, as a buffer process),
  `pipeline/timeline.py` (where a run's time goes).
- `python -m bench.throughput` (`throughput/__main__.py`): `throughput/study.py`, one table of component ratios from
  its parts, each run as a process: `throughput/buffer_ingest.py` (the buffer against raw ZeroMQ),
  `throughput/producer.py` (generation against vLLM offline, weight loads), `throughput/learner.py` (a learner step
  against plain transformers, publish against memcpy).
- `train_throughput.py`: generation inside a real `train` run against vLLM offline on the same model and cores.
- `weights.py`: the dist broadcast against memcpy and the file transport.

Robustness under load
- `soak.py`: one buffer, scripted producers at full rate for a while (memory flat, nothing lost).
- `flood.py`: one buffer under a flood of new identities and garbage while an honest producer works.

How benches run, and what they feed
- `guard.py`: every bench's entry point; a bench that fails, fails fast and leaves no process behind.
- `output.py`: where results go and how they are written (NAME.json beside NAME.md), for every bench.
- `run_all.py`: `make bench`, one bench after another, every failure reported at the end.
- `readme_results.py`: the README's result tables, rendered from bench/results/*.json (a test fails on drift).
- `cost_per_gain.py`: samples and train seconds per +0.01 of held-out gain for every arm of the e2e and peer_trl
  results, GRPO at its best among them (one of those tables; it runs nothing).
"""
