"""What the buffer reports: its own counters (declared once), the flat per-batch metrics that the learner logs to
metrics.jsonl, and the MetricsSnapshot that the live view and the supervisor read.

Keys that readers rely on (keep them): in a Batch, `buffer/samples_received` (the learner tells from it whether
producers make progress), `buffer/positive_rate_step`, `buffer/samples_per_released_group`, `eval/accuracy`,
`eval/version`, `producers/tokens_per_s`, `producers/busy`, and `ledger/<fate>_samples` / `ledger/<fate>_tokens`
for every fate of ledger.FATES with `ledger/generated_samples` / `ledger/generated_tokens` (the Scheduler's own
ledger counters are left out of the buffer/ keys: the ledger holds them); in a MetricsSnapshot, every Scheduler
metric under its own name, `buffer/<counter>`, `learner_version`, `producers`, `eval` (the latest row of
eval.jsonl), `progress` (see progress.py), `ledger` (ledger.py's dict), and the bad input tables
`malformed_by_sender`, `rejected_by_sender` and `rejected_by_reason`.

Nothing here changes state: callers pass what a function needs, and keep what must be remembered themselves.
"""

from __future__ import annotations

from typing import Any

# the buffer's own counters (the Scheduler's are counters.SCHEDULER_COUNTERS), reported as buffer/<name>
SERVICE_COUNTERS = {
    "malformed": "messages that could not be decoded (garbage, truncated, unknown kind, bad arrays, too many "
                 "frames)",
    "invalid": "messages that decode but hold a value no client sends (negative counts or versions, bad kind, an "
               "oversized heartbeat)",
    "refused_role": "learner-only messages (batches, versions, shutdown) from a connection without the learner role",
    "results_foreign": "results for a round leased to another connection (never applied)",
    "rejected_oov": "results holding a token id >= the model's vocab_size (their rounds are re-issued)",
    "rejected_values": "results whose values fail the edge checks (by reason in rejected_by_reason; re-issued)",
    "weights_refused": "weight announcements not of this run's weights (directory, or rendezvous) or version",
    "handler_errors": "messages (or timer runs) whose handler raised: logged with the state, dropped",
    "peers_refused": "producer messages from a new identity while every tracked identity held a lease",
    "peers_evicted": "idle producer identities forgotten to make room for a new one",
    "peers_expired": "producer identities forgotten after being silent for a while without a lease",
    "unroutable": "replies dropped: the peer was gone or not reading",
    "eval_rounds": "evaluation rounds handed out",
    "results_wrong_kind": "results whose kind was not their round's (a producer that does not echo the kind)",
    "snapshots": "snapshots written",
    "snapshot_errors": "snapshots that could not be written",
    "resumes": "times this run's buffer resumed from a snapshot",
}


def positive_counts(scheduler_metrics: dict[str, Any]) -> tuple[float, float]:
    """(positives, samples) received so far: what `batch_metrics` needs from the previous batch."""
    return float(scheduler_metrics["positives_received"]), float(scheduler_metrics["samples_received"])


def batch_metrics(scheduler_metrics: dict[str, Any], counters: dict[str, int],
                  producers: dict[str, dict[str, float]], last_eval: dict[str, Any] | None,
                  previous_counts: tuple[float, float], ledger: dict[str, int] | None = None) -> dict[str, float]:
    """Flat numeric metrics for the learner's per-step log line and metrics.jsonl.

    `previous_counts` is `positive_counts` at the previous batch: `buffer/positive_rate_step` is the pass rate of
    the samples generated since then (the cumulative rate hides progress).
    """
    flat = {f"buffer/{k}": float(v) for k, v in scheduler_metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not _ledger_counter(k)}
    flat.update({f"ledger/{k}": float(v) for k, v in (ledger or {}).items()})
    pos, num = positive_counts(scheduler_metrics)
    last_pos, last_num = previous_counts
    flat["buffer/positive_rate_step"] = (pos - last_pos) / (num - last_num) if num > last_num else 0.0
    flat.update({f"buffer/{k}": float(v) for k, v in counters.items()})
    if last_eval:
        flat["eval/accuracy"] = float(last_eval["accuracy"])
        flat["eval/version"] = float(last_eval["version"])
        flat["eval/pass_at_k"] = float(last_eval["pass_at_k"])
        for name, bench in last_eval["benchmarks"].items():
            flat[f"eval/{name}/ave_at_k"] = float(bench["ave_at_k"])
            flat[f"eval/{name}/pass_at_k"] = float(bench["pass_at_k"])
    flat["producers/tokens_per_s"] = float(sum(s.get("tokens_per_s", 0.0) for s in producers.values()))
    busy = [s.get("busy_fraction", 0.0) for s in producers.values()]
    flat["producers/busy"] = float(sum(busy) / len(busy)) if busy else 0.0
    return flat


def _ledger_counter(key: str) -> bool:
    return key.startswith(("fate_", "arrived_"))


def snapshot_metrics(scheduler_metrics: dict[str, Any], counters: dict[str, int], *, bad_senders: dict[str, Any],
                     snapshot: dict[str, float], peers: dict[str, int], producers: dict[str, dict[str, float]],
                     learner: dict[str, float],
                     last_eval: dict[str, Any] | None, evals_running: list[dict[str, int]],
                     eval_counts: dict[str, int], progress: dict[str, Any], uptime_s: float,
                     draining: bool, ledger: dict[str, int] | None = None) -> dict[str, Any]:
    """The MetricsSnapshot's content (nested; see the module docstring for the keys readers rely on)."""
    m: dict[str, Any] = dict(scheduler_metrics)
    m.update({f"buffer/{k}": v for k, v in counters.items()})
    m.update({key: dict(table) for key, table in bad_senders.items()})
    m["snapshot"] = dict(snapshot)
    m["peers"] = dict(peers)  # producer identities tracked, leases out
    m["producers"] = producers
    m["learner"] = learner
    # the row without its per-problem counts (eval.jsonl has them): a snapshot is polled often
    m["eval"] = {k: v for k, v in last_eval.items() if k != "correct"} if last_eval else {}
    m["evals_running"] = evals_running  # evaluations not written yet: version, problems done, problems
    m["eval_counts"] = dict(eval_counts)  # eval rounds issued and re-issued, results late, unknown, failed
    m["progress"] = progress
    m["uptime_s"] = uptime_s
    m["draining"] = draining
    m["ledger"] = dict(ledger or {})
    return m
