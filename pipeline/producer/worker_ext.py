"""A vLLM worker extension that loads new weights into the running model, in place.

vLLM mixes this class into its worker class (`worker_extension_cls`), so its methods run inside every worker
process and are reached with `AsyncLLM.collective_rpc(name, args=...)`. The engine core serves such calls
between two engine steps, so a reload never races a forward pass.

Invariant: a reload either copies every tensor of the file into the model's existing parameters (same
storage, so no CUDA graph or compiled kernel goes stale) or raises; vLLM's own `load_weights` maps checkpoint
names onto fused parameters (qkv_proj, gate_up_proj) and shards them for tensor parallelism.
"""

from __future__ import annotations

import time
from pathlib import Path


class WeightReloadExtension:
    """Methods vLLM adds to its worker: `reload_from_file(path)` copies a safetensors file into the model."""

    def reload_from_file(self, path: str) -> dict:
        """Load every tensor of the safetensors file `path` into the model, in place.

        Returns {"seconds": wall time, "num_tensors": tensors read}. Raises FileNotFoundError for a missing
        file and ValueError for a file with no tensors (a truncated or foreign file).
        """
        from safetensors import safe_open

        start = time.perf_counter()
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"weights file {file} does not exist (the learner writes it before it "
                                    "announces the version; was it deleted too early?)")
        count = 0

        def tensors():
            nonlocal count
            # Read one tensor at a time: peak extra memory is one tensor, not a second copy of the model.
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    count += 1
                    yield name, f.get_tensor(name)

        self.model_runner.reload_weights(weights_iterator=tensors())
        if count == 0:
            raise ValueError(f"weights file {file} holds no tensors")
        refreshed = refresh_tied_cpu_kernels(self.model_runner.get_model())
        return {"seconds": time.perf_counter() - start, "num_tensors": count, "refreshed": refreshed}


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
