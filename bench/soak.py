"""Soak: one real buffer process, N scripted producers at full rate and a scripted learner for a while.

Checks what a long run needs: the buffer's resident memory stays flat once warm (it is sampled every second),
and no message is lost: every result a producer sent is accounted for at the buffer (accepted, ignored as
duplicate/late/unknown, or rejected), and the learner got exactly the groups the buffer handed out.

    python -m bench.soak --seconds 60 --producers 8
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
from pathlib import Path

from bench import output
from pipeline.testing.processes import (
    buffer_command,
    prompts_accounted,
    results_received,
    scripted_command,
    send_shutdown,
    start,
    wait_for_buffer,
)
from pipeline.transport import free_port_pair

MB = 1 << 20


def run_soak(seconds: float = 60.0, num_producers: int = 8, batch: int = 32, warmup_s: float = 5.0,
             run_dir: str | Path | None = None, log=print) -> dict:
    """Run the soak and return its numbers (see the module docstring); processes are always cleaned up."""
    import psutil

    run_dir = Path(run_dir or tempfile.mkdtemp(prefix="soak-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port_pair()
    procs = []
    try:
        buf = start(buffer_command(port, run_dir, batch=batch), run_dir / "buffer.log")
        procs.append(buf)
        wait_for_buffer(port, proc=buf)
        mem = psutil.Process(buf.pid)
        rss_idle = mem.memory_info().rss
        outs = [run_dir / f"producer{i}.json" for i in range(num_producers)]
        producers = [start(scripted_command("producer", port, "--id", f"soak{i}", "--max-rounds", "8", "--out",
                                            str(outs[i])), run_dir / f"producer{i}.log")
                     for i in range(num_producers)]
        out_l = run_dir / "learner.json"
        learner = start(scripted_command("learner", port, "--steps", "1000000000", "--batch", str(batch),
                                         "--duration", str(seconds), "--no-shutdown", "--out", str(out_l)),
                        run_dir / "learner.log")
        procs += producers + [learner]
        t0 = time.monotonic()
        samples: list[tuple[float, int]] = []
        while learner.poll() is None and time.monotonic() - t0 < seconds + 60:
            samples.append((time.monotonic() - t0, mem.memory_info().rss))
            time.sleep(1.0)
        assert learner.wait(timeout=30) == 0, (run_dir / "learner.log").read_text()[-2000:]
        for p in producers:
            p.send_signal(signal.SIGTERM)
        for p in producers:
            assert p.wait(timeout=30) == 0, "a producer failed; see its log in " + str(run_dir)
        sent = [json.loads(o.read_text()) for o in outs]
        total_sent = sum(s["rounds"] for s in sent)
        m = wait_for_buffer(port, proc=buf, timeout_s=20, until=lambda m: results_received(m) >= total_sent)
        rss_end = mem.memory_info().rss
        send_shutdown(port, "soak over")
        buf.wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    summary = json.loads(out_l.read_text())
    warm = [rss for t, rss in samples if t >= warmup_s] or [rss_end]
    ids = summary["prompt_ids"]
    result = {
        "seconds": seconds, "producers": num_producers, "batch": batch,
        "rss_idle_mb": rss_idle / MB, "rss_warm_mb": warm[0] / MB, "rss_max_mb": max(warm) / MB,
        "rss_end_mb": rss_end / MB,
        "learner_steps": summary["steps"], "groups_trained": summary["groups"],
        "groups_consumed": m["groups_consumed"], "late_groups": summary["late_groups"],
        "repeated_prompt_ids": len(ids) - len(set(ids)),
        "results_sent": total_sent, "results_received": results_received(m),
        "samples_sent": sum(s["samples"] for s in sent), "samples_received": m["samples_received"],
        "results_ignored": m["results_ignored"], "results_rejected": m["results_rejected"],
        "aborted_at_producers": sum(s["aborted"] for s in sent),
        "rounds_issued": m["rounds_issued"], "rounds_reissued": m["rounds_reissued"],
        "admitted": m["admitted"], "released": m["released"], "prompts_accounted": prompts_accounted(m),
        "malformed": m["buffer/malformed"], "unroutable": m["buffer/unroutable"],
        "snapshots": m["buffer/snapshots"], "snapshot": m["snapshot"],
        "results_per_s": total_sent / seconds, "steps_per_s": summary["steps"] / seconds,
    }
    log(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32, help="groups per learner step")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before the reference memory sample")
    parser.add_argument("--run-dir", help="where logs go (default: a fresh temporary directory)")
    parser.add_argument("--out", help="write the numbers as JSON here")
    args = parser.parse_args(argv)
    result = run_soak(args.seconds, args.producers, args.batch, args.warmup, args.run_dir)
    if args.out:
        output.write_json(args.out, result)
    growth = result["rss_end_mb"] - result["rss_warm_mb"]
    lost = result["results_sent"] - result["results_received"]
    ok = growth < 50 and lost == 0 and result["prompts_accounted"] and result["late_groups"] == 0
    print(f"memory {result['rss_warm_mb']:.1f} MB after warm-up -> {result['rss_end_mb']:.1f} MB at the end "
          f"({growth:+.1f} MB); results sent {result['results_sent']}, accounted {result['results_received']}; "
          f"{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    from bench import guard

    guard.main(main)
