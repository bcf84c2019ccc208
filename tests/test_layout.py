"""pipeline/testing/ is for tests/ and bench/ only: no product module imports it; a package's map (its docstring)
names every module it holds (pipeline/buffer, its policy/, and bench/ by study)."""

from pathlib import Path

PIPELINE = Path(__file__).resolve().parents[1] / "pipeline"


def test_product_code_does_not_import_the_testing_package():
    offenders = [str(p.relative_to(PIPELINE)) for p in PIPELINE.rglob("*.py")
                 if "testing" not in p.relative_to(PIPELINE).parts[:1] and "pipeline.testing" in p.read_text()]
    assert not offenders, f"product modules import pipeline.testing: {offenders}"


def test_the_buffer_package_map_names_every_module():
    import pipeline.buffer

    modules = {p.name for p in (PIPELINE / "buffer").glob("*.py")} - {"__init__.py"}
    missing = sorted(m for m in modules if f"`{m}`" not in pipeline.buffer.__doc__)
    assert not missing, f"pipeline/buffer/__init__.py's map omits {missing}: add each with what it holds"


def test_the_policy_package_map_names_every_module():
    import pipeline.buffer.policy

    modules = {p.name for p in (PIPELINE / "buffer" / "policy").glob("*.py")} - {"__init__.py"}
    missing = sorted(m for m in modules if f"`{m}`" not in pipeline.buffer.policy.__doc__)
    assert not missing, f"pipeline/buffer/policy/__init__.py's map omits {missing}: add each with what it holds"


def test_the_bench_map_names_every_module():
    """bench/ is grouped by study in its package docstring: a new bench module must say which study it belongs to.
    Modules of a study package are named by their path below bench/ (`e2e/study.py`), so two `study.py` differ."""
    import bench

    root = PIPELINE.parent / "bench"
    modules = {p.relative_to(root).as_posix() for p in root.rglob("*.py")} - {"__init__.py"}
    modules = {m for m in modules if not m.endswith("/__init__.py")}
    missing = sorted(m for m in modules if f"`{m}`" not in bench.__doc__)
    assert not missing, f"bench/__init__.py's map omits {missing}: add each under its study"


def test_export_is_a_leaf_that_nothing_on_the_training_path_imports():
    """export.py is what users run after training; the learner writes checkpoints' hf/ through hf.py, below both."""
    allowed = {"export.py", "evaluate.py", "cli.py"}  # the command itself, `eval RUN_DIR`, and the command table
    offenders = [str(p.relative_to(PIPELINE)) for p in PIPELINE.rglob("*.py")
                 if str(p.relative_to(PIPELINE)) not in allowed and "pipeline.export" in p.read_text()]
    assert not offenders, f"modules import pipeline.export: {offenders}; import what they need from pipeline.hf"
    assert "pipeline.consumer" not in (PIPELINE / "hf.py").read_text()
