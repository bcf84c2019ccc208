"""Benchmarks, by study. Each study's entry point is the first module of its group (`python -m bench.NAME`); the
others are its parts. Every result lands in bench/results/; `make bench` (`run_all.py`) runs the everyday set.

Learning on a real model, against a real peer
- `peer_trl.py`: TRL's GRPOTrainer beside this project's GRPO, Ada-pos and Ada-balance on SmolLM2-135M-Instruct
  (same model, prompts, reward object, optimizer); held-out Ave@k against seconds and samples.
- `eval_noise.py`: how far one held-out evaluation moves with its sampling seeds alone (both evaluation paths).

Learning on the tiny model (the e2e study)
- `e2e.py`: the sweep (strategies x settings x seeds, real `train` runs), its statistics and report;
  `e2e_strategies.py` (what is compared, as data), `e2e_data.py` (its prompts), `e2e_runs.py` (one run, and what
  it measured), `e2e_eval.py` (held-out scores of the published versions, one engine), `e2e_stats.py` (means,
  curves, paired differences), `e2e_report.py` (markdown and plots).

The paper's Table 2 in a cost model
- `table2.py`: Table 2 reproduced, and this project's setups priced the same way; `costmodel.py` (every constant,
  with its source), `engine_sim.py` (a continuous-batching engine whose step time grows with batch and context),
  `reference_trace.py` (a round-synchronous run, kept to be re-priced), `table2_report.py` (markdown).

Sampling cost and allocation at paper scale, without a model
- `sampling.py`: samples and rounds per useful group for each exit rule and schedule; `allocation.py`: the
  allocation policies (uniform at M = 4, 8, 16, est, min_cost) and `allocation_report.py` (its goals and markdown);
  `sampling_sim.py` (simulated engines and learner around the real Scheduler), `population.py` (prompt pass rates
  over training, fitted to the paper's Fig. 5; shared with table2).

The pipeline's speed against plain baselines
- `pipeline.py`: steps per second at staleness 0, 1, 2 against the round-synchronous reference;
  `reference_buffer.py` (that reference, as a buffer process), `pipeline_timeline.py` (where a run's time goes).
- `throughput.py`: one table of component ratios, from `buffer_ingest.py` (the buffer against raw ZeroMQ),
  `producer.py` (generation against vLLM offline, weight loads), `learner.py` (a learner step against plain
  transformers, publish against memcpy).
- `train_throughput.py`: generation inside a real `train` run against vLLM offline on the same model and cores.
- `weights.py`: the dist broadcast against memcpy and the file transport.

Robustness under load
- `soak.py`: one buffer, scripted producers at full rate for a while (memory flat, nothing lost).
- `flood.py`: one buffer under a flood of new identities and garbage while an honest producer works.

How benches run, and what they feed
- `guard.py`: every bench's entry point; a bench that fails, fails fast and leaves no process behind.
- `run_all.py`: `make bench`, one bench after another, every failure reported at the end.
- `readme_results.py`: the README's result tables, rendered from bench/results/*.json (a test fails on drift).
- `cost_per_gain.py`: samples and train seconds per +0.01 of held-out gain for every arm of the e2e and peer_trl
  results, GRPO at its best among them (one of those tables; it runs nothing).
"""
