"""The consumer: the learner that trains on released groups and publishes versioned weights.

loss.py (PPO objective, LossConfig) <- batching.py (groups -> tensors) <- model.py (HF model, token log-probs)
<- backends/ (the LearnerBackend seam: torch/DDP, DeepSpeed ZeRO) <- learner.py (train_step, versions)
<- loop.py (the process's loop; fetch.py waits for batches, ranks.py shares them) <- main.py (the CLI);
pipeline/weights/ hands each version to the producers, checkpoint.py saves and restores the learner.
"""
