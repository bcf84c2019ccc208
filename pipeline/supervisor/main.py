"""`reinforce-ada train`: start the buffer, the producers and the learner from one config, watch them, show the
run, and stop everything cleanly.

Policy: a producer that dies is restarted (its rounds are re-issued by the buffer once its heartbeats stop); a
learner that dies is restarted with --resume (its last checkpoint; versions continue above the buffer's); a
buffer that dies is restarted with --resume (its last snapshot). The learner finishing (exit 0) ends the run; a
process that keeps dying is fatal, reported with its name and the last lines of its log. Ctrl-C stops everything.
No child outlives the supervisor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from pipeline.config import Config, ConfigError, dumps_toml, load_config

MAX_PRODUCER_RESTARTS = 5
MAX_RESTARTS = 3  # learner and buffer


class RunFailed(RuntimeError):
    pass


def _python() -> list[str]:
    return [sys.executable, "-m", "pipeline.cli"]


def plan_children(cfg: Config, cfg_path: Path, model_dir: str, log_dir: Path, router_port: int,
                  control_port: int) -> list:
    """The buffer, producers and learner of a run as Child objects (not started)."""
    from pipeline.supervisor.procs import Child

    host = cfg.endpoints.host
    connect = f"{host}:{router_port}"
    ports = ["--endpoints.router_port", str(router_port), "--endpoints.control_port", str(control_port)]
    children = [Child("buffer", "buffer", _python() + ["buffer", "--config", str(cfg_path), "--model", model_dir]
                      + ports, log_dir)]
    for i in range(cfg.producers.count):
        env = {"CUDA_VISIBLE_DEVICES": cfg.producers.devices[i]} if cfg.producers.devices else {}
        children.append(Child(f"producer-{i}", "producer",
                              _python() + ["producer", "--connect", connect, "--config", str(cfg_path),
                                           "--id", f"producer-{i}", "--model", model_dir] + ports, log_dir, env))
    learner_args = ["--config", str(cfg_path), "--connect", connect, "--model", model_dir] + ports
    if cfg.learner.num_ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={cfg.learner.num_ranks}", "-m", "pipeline.consumer.main"] + learner_args
    else:
        cmd = _python() + ["learner"] + learner_args
    children.append(Child("learner", "learner", cmd, log_dir))
    return children


def _wait_for_buffer(router_url: str, control_url: str, buffer, timeout_s: float = 60.0) -> None:
    from pipeline import protocol as P
    from pipeline.transport import BufferClient

    client = BufferClient(router_url, control_url, "supervisor-probe")
    try:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if buffer.poll() is not None:
                raise RunFailed(f"the buffer exited with code {buffer.poll()} while starting:\n{buffer.tail()}")
            if client.request(P.MetricsRequest("supervisor"), P.MetricsSnapshot, 1.0) is not None:
                return
        raise RunFailed(f"the buffer did not answer within {timeout_s:.0f} s:\n{buffer.tail()}")
    finally:
        client.close()


def _wait_for_producers(router_url: str, control_url: str, producers: list, timeout_s: float = 600.0) -> None:
    from pipeline import protocol as P
    from pipeline.transport import BufferClient

    client = BufferClient(router_url, control_url, "supervisor-probe")
    try:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for prod in producers:
                if prod.poll() is not None:
                    raise RunFailed(f"{prod.name} exited with code {prod.poll()} while starting; last lines of "
                                    f"{prod.log_path}:\n{prod.tail()}")
            snap = client.request(P.MetricsRequest("supervisor"), P.MetricsSnapshot, 1.0)
            if snap is not None and snap.metrics.get("producers_alive", 0) >= len(producers):
                return
            time.sleep(0.5)
        raise RunFailed(f"the producers did not all come up within {timeout_s:.0f} s; see their logs")
    finally:
        client.close()


def _restart(child, code: int, flag: str | None, limit: int, state, tty: bool) -> None:
    """Start a dead child again (with `flag` added once), or fail the run once it died `limit` + 1 times."""
    if child.restarts >= limit:
        raise RunFailed(f"{child.name} died {child.restarts + 1} times (last exit code {code}); last lines of "
                        f"{child.log_path}:\n{child.tail()}")
    child.restarts += 1
    if flag and flag not in child.cmd:
        child.cmd = child.cmd + [flag]
    state.message = f"restarted {child.name} (exit code {code})"
    if not tty:
        print(f"{child.name} exited with code {code}; restarting it ({child.restarts})", flush=True)
    child.start()


def _wait_exit(child, timeout_s: float) -> int | None:
    end = time.monotonic() + timeout_s
    while child.poll() is None and time.monotonic() < end:
        time.sleep(0.1)
    return child.poll()


def run(cfg: Config, overrides: list[str], config_path: str | None) -> int:
    from pipeline import protocol as P
    from pipeline.models import resolve_model_path
    from pipeline.supervisor.live import JsonlTail, RunState, render
    from pipeline.supervisor.procs import stop_all, write_commands
    from pipeline.transport import BufferClient, free_port_pair

    run_dir = cfg.run_dir
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if cfg.model.path == "tiny":
        print("preparing the tiny model (built once into .cache/tiny-model, about a minute)...", flush=True)
    model_dir = resolve_model_path(cfg)
    cfg_path = run_dir / "config.toml"
    cfg_path.write_text(dumps_toml(cfg))
    router_port = cfg.endpoints.router_port or free_port_pair()
    control_port = router_port + 1
    children = plan_children(cfg, cfg_path, model_dir, log_dir, router_port, control_port)
    write_commands(run_dir / "commands.sh", children, os.getcwd())
    by_name = {c.name: c for c in children}
    buffer, learner = by_name["buffer"], by_name["learner"]
    producers = [c for c in children if c.role == "producer"]
    host = cfg.endpoints.host
    router_url, control_url = f"tcp://{host}:{router_port}", f"tcp://{host}:{control_port}"

    state = RunState(cfg.run.name, cfg.learner.num_steps)
    steps_tail, eval_tail = JsonlTail(run_dir / "metrics.jsonl"), JsonlTail(run_dir / "eval.jsonl")
    steps_tail.read(), eval_tail.read()  # a resumed run shows only what this run adds
    tty = sys.stdout.isatty() and cfg.run.live
    stopping = {"reason": ""}

    def on_signal(signum, frame):
        stopping["reason"] = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated"

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    client = None
    live = None
    exit_code = 0
    try:
        buffer.start()
        _wait_for_buffer(router_url, control_url, buffer)
        for child in producers:
            child.start()
        # the learner starts once every producer's engine is up: a learner started earlier only waits, and a short
        # run would otherwise finish on the first engine alone
        _wait_for_producers(router_url, control_url, producers)
        learner.start()
        print(f"run {cfg.run.name}: {len(producers)} producer(s), learner x{cfg.learner.num_ranks}; logs in {log_dir}",
              flush=True)
        client = BufferClient(router_url, control_url, "supervisor")
        if tty:
            from rich.live import Live

            live = Live(render(state), refresh_per_second=2, transient=False)
            live.start()
        last_poll = 0.0
        while True:
            if stopping["reason"]:
                raise RunFailed(stopping["reason"])
            code = learner.poll()
            if code == 0:
                break
            if code is not None:
                # the learner resumes from its last checkpoint; the buffer kept its state meanwhile
                _restart(learner, code, "--resume", MAX_RESTARTS, state, tty)
            if buffer.poll() is not None:
                # a clean buffer exit follows the learner's Shutdown: give the learner time to exit on its own
                if buffer.poll() == 0 and _wait_exit(learner, 60.0) == 0:
                    break
                # the buffer resumes from its snapshot; clients reconnect by themselves
                _restart(buffer, buffer.poll(), "--resume", MAX_RESTARTS, state, tty)
            for prod in producers:
                code = prod.poll()
                if code is not None:  # its rounds are re-issued by the buffer once its heartbeats stop
                    _restart(prod, code, None, MAX_PRODUCER_RESTARTS, state, tty)
            now = time.monotonic()
            if now - last_poll >= 1.0:
                last_poll = now
                snap = client.request(P.MetricsRequest("supervisor"), P.MetricsSnapshot, 0.5)
                if snap is not None:
                    state.buffer = snap.metrics
            for row in steps_tail.read():
                state.steps.append(row)
                if not tty:
                    print(state.step_line(row), flush=True)
            for row in eval_tail.read():
                state.evals.append(row)
                if not tty:
                    print(f"eval | version {row['version']} | Ave@{row['k']} {row['accuracy']:.3f} over "
                          f"{row['problems']} problems", flush=True)
            state.children = [(p.name, "running" if p.poll() is None else "down", str(p.restarts))
                              for p in producers]
            if live is not None:
                live.update(render(state))
            time.sleep(0.2)
        # the learner finished: the buffer runs the final evaluation, then shuts down on the learner's request
        end = time.monotonic() + cfg.buffer.lease_s + 30
        while buffer.poll() is None and time.monotonic() < end and not stopping["reason"]:
            time.sleep(0.2)
    except RunFailed as exc:
        print(f"\nrun stopped: {exc}", file=sys.stderr, flush=True)
        exit_code = 130 if "interrupted" in str(exc) else 1
    finally:
        if live is not None:
            live.stop()
        if client is not None:
            client.close()
        stop_all(children)
        if not cfg.weights.dir:  # the default weights folder lives in /dev/shm (RAM): checkpoints hold the model
            shutil.rmtree(cfg.weights_dir, ignore_errors=True)
        for s, handler in old.items():
            signal.signal(s, handler)
    state.steps += steps_tail.read()
    state.evals += eval_tail.read()
    _summary(cfg, state, run_dir, time.monotonic() - t0)
    return exit_code


def _summary(cfg: Config, state, run_dir: Path, wall_s: float) -> None:
    if state.evals:
        first, last = state.evals[0], state.evals[-1]
        print(f"held-out Ave@{first['k']}: {first['accuracy']:.3f} at version {first['version']} -> "
              f"{last['accuracy']:.3f} at version {last['version']}")
    print(f"{len(state.steps)} learner steps in {wall_s / 60:.1f} min; run directory {run_dir}")
    try:
        from pipeline.plots import plot_runs

        paths = plot_runs([run_dir], run_dir / "plots")
        print(f"plots: {', '.join(str(p) for p in paths)}")
    except Exception as exc:  # noqa: BLE001 - plotting must never turn a finished run into a failure
        print(f"could not draw plots: {exc}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reinforce-ada train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="TOML config (default: configs/tiny.toml's settings, the CPU run)")
    args, overrides = parser.parse_known_args(argv)
    config_path = args.config
    if config_path is None:
        default = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
        config_path = str(default) if default.is_file() else None
    try:
        cfg = load_config(config_path, overrides)
        for key, files in (("data.train_files", cfg.data.train_files), ("data.eval_files", cfg.data.eval_files)):
            for f in files:
                if f != "arithmetic" and not Path(f).is_file():
                    raise ConfigError(f"{key}: {f} does not exist (JSONL or Parquet files, or \"arithmetic\")")
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    return run(cfg, overrides, config_path)


if __name__ == "__main__":
    sys.exit(main())
