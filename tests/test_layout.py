"""pipeline/testing/ is for tests/ and bench/ only: no product module imports it."""

from pathlib import Path

PIPELINE = Path(__file__).resolve().parents[1] / "pipeline"


def test_product_code_does_not_import_the_testing_package():
    offenders = [str(p.relative_to(PIPELINE)) for p in PIPELINE.rglob("*.py")
                 if "testing" not in p.relative_to(PIPELINE).parts[:1] and "pipeline.testing" in p.read_text()]
    assert not offenders, f"product modules import pipeline.testing: {offenders}"
