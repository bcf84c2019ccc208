"""A test double of the producer's worker extension: from its second weight load on it takes SLOW_S per tensor and
says so on stdout, so a test can kill its producer in the middle of a broadcast. Used through
`--producers.engine.extra '{worker_extension_cls = "tests.support.slow_weights.SlowReloadExtension"}'`."""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from pipeline.producer.worker_ext import WeightReloadExtension

SLOW_S = 1.0
MARK = "slow weight receive started"


class SlowReloadExtension(WeightReloadExtension):
    def _reload(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> dict:
        self._num_loads = getattr(self, "_num_loads", 0) + 1
        if self._num_loads < 2:
            return super()._reload(tensors)

        def slow() -> Iterator[tuple[str, torch.Tensor]]:
            for i, item in enumerate(tensors):
                if i == 0:
                    print(MARK, flush=True)
                time.sleep(SLOW_S)
                yield item

        return super()._reload(slow())
