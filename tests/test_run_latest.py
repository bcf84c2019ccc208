"""`make run` works every time: each run gets its own directory, and `<run.dir>/latest` points at the newest."""

import subprocess
from pathlib import Path

from pipeline.supervisor.plan import link_latest

REPO = Path(__file__).parents[1]


def test_latest_points_at_the_newest_run_and_never_replaces_a_real_folder(tmp_path):
    first, second = tmp_path / "tiny-1", tmp_path / "tiny-2"
    first.mkdir()
    second.mkdir()
    link_latest(first)
    assert (tmp_path / "latest").resolve() == first.resolve()
    link_latest(second)
    assert (tmp_path / "latest").resolve() == second.resolve()
    assert (tmp_path / "latest").readlink() == Path("tiny-2")  # relative: the runs folder can move
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "latest").mkdir()  # a user's own folder named latest
    (other / "run").mkdir()
    link_latest(other / "run")
    assert (other / "latest").is_dir() and not (other / "latest").is_symlink()


def test_make_run_names_a_new_run_directory_unless_args_resume_or_name_one():
    def command(args: str) -> str:
        out = subprocess.run(["make", "-n", "run", f"ARGS={args}", "STAMP=/dev/null"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout
        return next(line for line in out.splitlines() if "pipeline.cli train" in line)

    assert "--run.name tiny-" in command("")
    assert "--run.name" not in command("--resume runs/latest")
    assert command("--run.name mine").count("--run.name") == 1
