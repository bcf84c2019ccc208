"""End to end: `reinforce-ada train` runs the buffer, two real vLLM producers and the learner on the tiny model
for a few steps, and leaves a complete run directory behind, with every generated token accounted for."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.buffer.ledger import FATES

pytestmark = pytest.mark.slow
REPO = Path(__file__).parents[1]


def test_train_end_to_end(tmp_path, tiny_model_dir):
    steps = 4
    cmd = [sys.executable, "-m", "pipeline.cli", "train", "--config", str(REPO / "configs" / "tiny.toml"),
           "--run.dir", str(tmp_path), "--run.name", "e2e", "--learner.num_steps", str(steps),
           "--learner.batch_prompts", "16", "--learner.checkpoint_every", "2", "--learner.eval_every", "2",
           "--eval.num_problems", "40", "--producers.count", "2", "--endpoints.router_port", "0"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    run = tmp_path / "e2e"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + _logs(run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))  # versions advance one per step
    for r in rows:
        assert r["num_groups"] == 16 and r["num_samples"] == 16 * 4
        assert r["group_size_min"] == r["group_size_max"] == 4
        assert r["mixed_frac"] == 1.0  # balance + drop: every trained group has a right and a wrong answer
        assert r["staleness_max"] <= 1  # buffer.max_staleness in tiny.toml
    _assert_every_token_accounted_for(run, rows)
    # both producers took part: the learner starts once both are up, and each followed the weight versions
    assert rows[0]["buffer/producers_alive"] == 2
    for name in ("producer-0", "producer-1"):
        log = (run / "logs" / f"{name}.log").read_text(errors="replace")
        assert f"producer {name} ready" in log and "loaded weights version" in log, name
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 2, 4]
    assert all(0.0 <= e["accuracy"] <= 1.0 for e in evals)
    assert (run / "checkpoints" / "latest").exists()
    assert {p.name for p in (run / "plots").glob("*.png")} >= {"reward.png", "accuracy.png",
                                                              "samples_per_group.png", "staleness.png",
                                                              "utilisation.png", "ledger.png"}
    assert (run / "commands.sh").read_text().count("pipeline.cli") == 4  # buffer, 2 producers, learner
    for name in ("buffer", "producer-0", "producer-1", "learner"):
        assert (run / "logs" / f"{name}.log").stat().st_size > 0
    assert "held-out Ave@4" in proc.stdout
    _assert_no_orphans(run)
    # the run ends by naming its trained model (a Hugging Face export), and `eval --model RUN_DIR` evaluates it
    export = run / "checkpoints" / f"step_{steps:06d}" / "hf"
    assert f"trained model (Hugging Face format, loads in transformers and vLLM): {export}" in proc.stdout
    out = tmp_path / "eval.json"
    ev = subprocess.run([sys.executable, "-m", "pipeline.cli", "eval", "--model", str(run), "--k", "2", "--limit",
                         "20", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["model"] == str(export) and result["benchmarks"]["arithmetic"]["problems"] == 20


def _assert_every_token_accounted_for(run: Path, rows: list[dict]) -> None:
    """The ledger (pipeline/buffer/ledger.py) conserves: once both producers' final reports are in, the fates the
    buffer counted sum to the samples and tokens the producers' engines reported generating, exactly (nothing
    unreported, nothing lost), and its trained samples are the ones the learner's rows say it trained on."""
    ledger = json.loads((run / "ledger.json").read_text())
    print("ledger:", json.dumps(ledger))
    assert ledger["complete"], ledger
    for unit in ("samples", "tokens"):
        assert ledger[f"unreported_{unit}"] == 0 and ledger[f"lost_{unit}"] == 0, ledger
        assert sum(ledger[f"{fate}_{unit}"] for fate in FATES) == ledger[f"generated_{unit}"] > 0, ledger
        assert all(ledger[f"{fate}_{unit}"] >= 0 for fate in FATES), ledger
    assert ledger["trained_samples"] == sum(r["num_samples"] for r in rows)
    assert ledger["eval_samples"] > 0 and ledger["downsampled_samples"] > 0  # rounds of 8 kept to groups of 4
    # the learner's rows carry the ledger as it stood at each batch; the trained part grows by a batch per step
    assert [r["ledger/trained_samples"] for r in rows] == [64 * (i + 1) for i in range(len(rows))]


def _logs(run: Path) -> str:
    out = []
    for log in sorted((run / "logs").glob("*.log")) if (run / "logs").is_dir() else []:
        out.append(f"\n--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]))
    return "".join(out)


def _assert_no_orphans(run: Path) -> None:
    """No process of this run survives the supervisor (their command lines name the run's config file)."""
    marker = str(run / "config.toml")
    left = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                left.append(cmdline)
    assert not left, left
