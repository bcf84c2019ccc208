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
        return {"seconds": time.perf_counter() - start, "num_tensors": count}
