"""The Scheduler's counters, each declared once with what it counts: `Scheduler.metrics()` reports every one under
its name, the learner logs them as buffer/<name>, and snapshots carry them.

Invariant (waste is counted exactly): every sample that reaches the buffer for a training round is counted once,
in samples_received (it arrived for a round in flight, each index once) or in samples_late / results_ignored;
of the received ones, those that never joined a pool are samples_discarded; samples that never arrived are
samples_cut (their round was cut by the exit rule) and producers report what they aborted in samples_aborted /
tokens_aborted. The ledger of every generated sample and token by fate (ledger.py) counts with its own counters,
declared there and added here.
"""

from pipeline.buffer.ledger import LEDGER_COUNTERS

MAX_REJECTIONS = 3  # a prompt whose results are rejected this often is given up on (counted as unservable)
SCHEDULER_COUNTERS = {  # every counter, declared once: metrics() reports each under its name
    "admitted": "prompts admitted (a new prompt id each time an example is served)",
    "released": "groups released (re-releases of re-opened groups included)",
    "released_partial": "groups released without the exit rule holding (after max_rounds)",
    "released_signal": "groups released holding both rewards (the useful ones)",
    "dropped_unresolved": "prompts given up on without a group (zero variance after max_rounds, or unservable)",
    "dropped_zero_variance": "prompts whose exit rule held on a pool with no signal, dropped (unresolved=drop)",
    "stale_evictions": "samples evicted from pools as too stale",
    "reopened": "waiting groups re-opened because a sample went stale",
    "rounds_issued": "rounds handed out (re-issues included)",
    "rounds_reissued": "rounds cancelled and offered again (expired, aborted, rejected, resumed)",
    "rounds_expired": "rounds whose lease ran out or whose producer went silent",
    "rounds_aborted": "rounds cancelled because their samples would be stale or their prompt was given up on",
    "results_rejected": "results with the wrong number of samples, or found unusable by the caller",
    "samples_received": "samples that arrived for a round in flight (each index once)",
    "positives_received": "positive samples among them",
    "tokens_received": "completion tokens of those samples",
    "pool_samples_released": "pool samples behind the released groups",
    "pool_tokens_released": "completion tokens of those pools",
    "tokens_kept": "completion tokens of the samples the released groups kept",
    "prompts_unservable": "prompts dropped because producers could not serve them",
    "samples_discarded": "samples that arrived but never joined a pool: the exit rule held first",
    "tokens_discarded": "completion tokens of discarded samples and of samples of late results (wasted)",
    "samples_late": "samples of results ignored as late (their round was cut, aborted or re-issued)",
    "rounds_cut": "rounds the exit rule ended with samples still running (aborted at the producer)",
    "samples_cut": "samples of those rounds that had not arrived when the exit rule held",
    "samples_aborted": "samples producers report they aborted (cut, stale or expired rounds)",
    "tokens_aborted": "tokens those aborted samples had generated (wasted)",
    "deferred": "examples the allocation policy deferred to a later epoch",
    **LEDGER_COUNTERS,
}
IGNORE_REASONS = ("duplicate", "late", "unknown")
