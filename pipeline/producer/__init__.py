"""The producer: one vLLM engine that generates, scores and streams rounds for the buffer (see worker.py)."""
