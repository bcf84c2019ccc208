"""Weight transports: how the learner's new weights reach the producers' engines (the seam is in base.py)."""

from pipeline.weights.base import (
    WeightLoader,
    WeightPublisher,
    make_loader,
    make_publisher,
    uri_problem,
    version_problem,
)

__all__ = ["WeightLoader", "WeightPublisher", "make_loader", "make_publisher", "uri_problem", "version_problem"]
