"""Experiment trackers (`run.trackers`): TensorBoard, Weights & Biases and Trackio, fed by the learner's rank 0
from where it writes metrics.jsonl (consumer/runlog.py).

Each tracker is a class with the small `Tracker` interface below, made by `open_trackers` for the names in
run.trackers (none by default). Its package is imported only when it is named; a missing one is a TrackerError
that names the `pip install` (extras `tensorboard`, `wandb`, `trackio`). What every tracker gets:
- at start, the resolved config (TensorBoard: as TOML text; wandb and trackio: as the run's config);
- per learner step, every numeric value of the metrics.jsonl row at x = its version, except the `eval/*` values
  the row repeats from the latest evaluation;
- per evaluation (each eval.jsonl row), `eval/accuracy`, `eval/pass_at_k`, `eval/<benchmark>/ave_at_k` and
  `eval/<benchmark>/pass_at_k` at x = the evaluated version. Evaluations finish after later steps, so wandb, whose
  steps must only increase, plots them against `eval/version`;
- every run.samples_every steps, a table of sample completions: prompt, completion, reward, rounds, version.

Invariants: a tracker never stops training: once open, an error from it is logged and that tracker is closed
(metrics.jsonl still gets every row). A resumed run continues its trackers: TensorBoard purges what was logged past
the checkpoint's version, wandb resumes the same run id (kept in run_dir/trackers.json).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import math
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

IDS_FILE = "trackers.json"  # run ids that let a resumed run continue the same tracker runs
TABLE_COLUMNS = ["prompt", "completion", "reward", "rounds", "version"]
EVAL_AXIS = "eval/version"


class TrackerError(RuntimeError):
    """A tracker that cannot start (its package is missing, or it refused to open); the message says what to do."""


class Tracker(Protocol):
    """One experiment tracker, opened for a run."""

    name: str

    def log(self, metrics: dict[str, float], step: int, axis: str) -> None:
        """Scalars at x = `step` on the axis `axis` ("version" for steps, EVAL_AXIS for evaluations)."""
        ...

    def table(self, key: str, rows: list[list[Any]], step: int) -> None:
        """A table of rows with TABLE_COLUMNS at version `step`."""
        ...

    def close(self) -> None:
        """Flush and release (idempotent)."""
        ...


PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}  # tracker -> its package


def _missing(extra: str, why: str) -> TrackerError:
    return TrackerError(f'run.trackers names "{extra}", which needs its package: pip install '
                        f"'reinforce-ada[{extra}]' (or: pip install {PACKAGES[extra]}); {why}")


def _require(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise _missing(extra, f"importing {module} failed: {exc}") from None


def check_trackers(names: list[str]) -> None:
    """Raise TrackerError, naming the pip install, for a tracker whose package is not installed (without importing
    it: entry points call this before anything slow starts)."""
    for name in names:
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise _missing(name, "it is not installed")


class TensorBoardTracker:
    """Event files under run_dir/tensorboard (torch's SummaryWriter, which needs the tensorboard package)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path, config_toml: str, resumed_from: int | None) -> None:
        _require("tensorboard", "tensorboard")
        writer_cls = _require("torch.utils.tensorboard", "tensorboard").SummaryWriter
        # a resumed run hides what the stopped one logged past its checkpoint: those updates were lost
        purge = resumed_from + 1 if resumed_from is not None else None
        self.writer = writer_cls(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        if resumed_from is None:  # indented: the text plugin renders markdown, and this is a code block
            self.writer.add_text("config", "    " + config_toml.replace("\n", "\n    "), 0)

    def log(self, metrics: dict[str, float], step: int, axis: str) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def table(self, key: str, rows: list[list[Any]], step: int) -> None:
        def cell(v: Any) -> str:
            return str(v).replace("|", "\\|").replace("\n", "<br>")

        lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + "---|" * len(TABLE_COLUMNS)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.writer.add_text(key, "\n".join(lines), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run named run.name in project run.project, its files under run_dir/wandb (WANDB_MODE=offline keeps
    it off the network; `wandb sync` uploads it later)."""

    name = "wandb"

    def __init__(self, run_dir: Path, name: str, project: str, config: dict, run_id: str | None) -> None:
        self.wandb = _require("wandb", "wandb")
        try:
            self.run = self.wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(run_dir),
                                       config=config)
        except Exception as exc:  # noqa: BLE001 - wandb raises its own kinds (no login, no network)
            raise TrackerError(f"wandb could not start: {exc} (log in with `wandb login`, or set "
                               "WANDB_MODE=offline)") from exc
        self.run.define_metric("version")
        self.run.define_metric(EVAL_AXIS)
        self.run.define_metric("eval/*", step_metric=EVAL_AXIS)

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, metrics: dict[str, float], step: int, axis: str) -> None:
        if axis == EVAL_AXIS:  # at wandb's current step; plotted against eval/version
            self.run.log({**metrics, EVAL_AXIS: step})
        else:
            self.run.log({**metrics, "version": step}, step=step)

    def table(self, key: str, rows: list[list[Any]], step: int) -> None:
        self.run.log({key: self.wandb.Table(columns=TABLE_COLUMNS, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()
        # and wait for wandb's service to write it all: finish() can return while the records are still in the
        # service's buffer (an offline run's file held only its header when read right after, on a loaded machine)
        self.wandb.teardown()


class TrackioTracker:
    """A trackio run named run.name in project run.project (trackio's local store, or its Space when configured
    through trackio's own environment variables)."""

    name = "trackio"

    def __init__(self, name: str, project: str, config: dict, resumed: bool) -> None:
        self.trackio = _require("trackio", "trackio")
        self.trackio.init(project=project, name=name, config=config, resume="allow" if resumed else "never")

    def log(self, metrics: dict[str, float], step: int, axis: str) -> None:
        self.trackio.log(metrics, step=step)

    def table(self, key: str, rows: list[list[Any]], step: int) -> None:
        self.trackio.log({key: self.trackio.Table(columns=TABLE_COLUMNS, data=rows)}, step=step)

    def close(self) -> None:
        self.trackio.finish()


class Trackers:
    """The open trackers of a run; every call goes to each of them (see the module docstring)."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = list(trackers)

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def _each(self, what: str, call) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # noqa: BLE001 - a tracker never stops training
                log.error("tracker %s failed to %s (%s: %s); it is closed, metrics.jsonl keeps every row",
                          tracker.name, what, type(exc).__name__, exc)
                self.trackers.remove(tracker)
                try:
                    tracker.close()
                except Exception:  # noqa: BLE001 - already reported
                    pass

    def log_step(self, row: dict[str, Any]) -> None:
        """One metrics.jsonl row."""
        step = int(row.get("version", row.get("step", 0)))
        metrics = {k: float(v) for k, v in row.items() if _number(v) and k not in ("step", "version", "time")
                   and not k.startswith("eval/")}
        self._each("log a step", lambda t: t.log(metrics, step, "version"))

    def log_eval(self, row: dict[str, Any]) -> None:
        """One eval.jsonl row (the buffer's evaluation of one version)."""
        metrics = {"eval/accuracy": row.get("accuracy"), "eval/pass_at_k": row.get("pass_at_k")}
        for name, bench in (row.get("benchmarks") or {}).items():
            metrics[f"eval/{name}/ave_at_k"] = bench.get("ave_at_k")
            metrics[f"eval/{name}/pass_at_k"] = bench.get("pass_at_k")
        metrics = {k: float(v) for k, v in metrics.items() if _number(v)}
        self._each("log an evaluation", lambda t: t.log(metrics, int(row["version"]), EVAL_AXIS))

    def log_samples(self, rows: list[list[Any]], step: int) -> None:
        """A table of sample completions (rows of TABLE_COLUMNS) at version `step`."""
        self._each("log a table", lambda t: t.table("samples", rows, step))

    def close(self) -> None:
        self._each("close", lambda t: t.close())
        self.trackers = []


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def open_trackers(names: list[str], run_dir: Path, run_name: str, project: str, config: dict, config_toml: str,
                  resumed_from: int | None = None) -> Trackers:
    """Open the trackers `names` (run.trackers) for the run in `run_dir`; raises TrackerError (closing those already
    open) when one cannot start. `resumed_from`: the checkpoint version a resumed run continues from."""
    ids_path = run_dir / IDS_FILE
    ids = json.loads(ids_path.read_text()) if resumed_from is not None and ids_path.is_file() else {}
    opened: list[Tracker] = []
    try:
        for name in names:
            if name == "tensorboard":
                opened.append(TensorBoardTracker(run_dir, config_toml, resumed_from))
            elif name == "wandb":
                tracker = WandbTracker(run_dir, run_name, project, config, ids.get("wandb"))
                ids["wandb"] = tracker.run_id
                opened.append(tracker)
            elif name == "trackio":
                opened.append(TrackioTracker(run_name, project, config, resumed_from is not None))
            else:
                raise TrackerError(f"run.trackers: unknown tracker {name!r} (tensorboard, wandb, trackio)")
    except BaseException:
        Trackers(opened).close()
        raise
    if ids:
        ids_path.write_text(json.dumps(ids) + "\n")
    return Trackers(opened)
