"""The consumer: the learner that trains on released groups and publishes versioned weights.

loss.py (PPO objective) <- batching.py (groups -> tensors) <- model.py (HF model, token log-probs)
<- backends.py (torch/DDP, DeepSpeed ZeRO) <- learner.py (train_step, versions) <- main.py (the process);
weights.py publishes weight files, checkpoint.py saves and restores the learner.
"""
