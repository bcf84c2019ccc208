"""A vLLM worker extension that loads new weights into the running model, in place.

vLLM mixes this class into its worker class (`worker_extension_cls`), so its methods run inside every worker
process and are reached with `AsyncLLM.collective_rpc(name, args=...)`. The engine core serves such calls
between two engine steps, so a reload never races a forward pass. Both weight transports end in `_reload`:
`reload_from_file` reads a safetensors file (the file transport), `receive_weights` streams the learner's
broadcast (the dist transport, pipeline/weights/dist_receive.py).

Invariant: a reload either copies every tensor it is given into the model's existing parameters (same storage, so
no CUDA graph or compiled kernel goes stale) or raises (or, for a broadcast, reports what reached the model);
vLLM's own `load_weights` maps checkpoint names onto fused parameters (qkv_proj, gate_up_proj) and shards them for
tensor parallelism.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from pipeline.weights.dist_plan import Plan
from pipeline.weights.dist_receive import model_bytes, receive
from pipeline.weights.file import iter_file


class WeightReloadExtension:
    """Methods vLLM adds to its worker: `reload_from_file(path)` and `receive_weights(plan)`."""

    def reload_from_file(self, path: str) -> dict:
        """Load every tensor of the safetensors file `path` into the model, in place.

        Returns {"seconds": wall time, "num_tensors": tensors read, "refreshed": tied layers re-packed}. Raises
        FileNotFoundError for a missing file and ValueError for a file with no tensors (a truncated or foreign file).
        """
        start = time.perf_counter()
        # Read one tensor at a time: peak extra memory is one tensor, not a second copy of the model.
        info = self._reload(iter_file(path))
        if info["num_tensors"] == 0:
            raise ValueError(f"weights file {path} holds no tensors")
        return {**info, "seconds": time.perf_counter() - start}

    def receive_weights(self, plan: bytes) -> dict:
        """Receive the learner's broadcast of one version (an encoded dist Plan) into the model, in place.

        Returns {"ok": True, "seconds", "num_tensors", "num_bytes", "refreshed"}, or {"ok": False, "touched": any
        tensor reached the model, "error": why}: a failed transfer is reported, not raised.
        """
        max_bytes = model_bytes(self.model_runner.get_model(), self.parallel_config.tensor_parallel_size)
        return receive(self, Plan.decode(plan), self._reload, max_bytes)

    def _reload(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> dict:
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for item in tensors:
                count += 1
                yield item

        self.model_runner.reload_weights(weights_iterator=counted())
        refreshed = refresh_tied_cpu_kernels(self.model_runner.get_model())
        return {"num_tensors": count, "refreshed": refreshed}


def refresh_tied_cpu_kernels(model) -> int:
    """Re-pack the CPU GEMM weights of layers that share their weight with another layer; returns how many.

    vLLM's CPU backend packs each linear layer's weight for its GEMM kernel once, after loading. An in-place
    reload re-packs the layers whose weights it loaded, but a tied output layer (`lm_head` sharing the input
    embedding, as in Qwen2.5 and Llama 3.2) loads nothing of its own, so it would go on computing logits with
    the packed copy of the OLD embedding: samples from stale weights, and log-probs the learner cannot match.
    """
    owners: dict[int, int] = {}
    for _, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    refreshed = 0
    for _, module in model.named_modules():
        weight = getattr(module, "weight", None)
        method = getattr(module, "quant_method", None)
        if (getattr(module, "cpu_linear", None) is not None and weight is not None and weight.numel()
                and owners.get(id(weight), 0) > 1 and hasattr(method, "process_weights_after_loading")):
            method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed
