"""Helpers that the tests and the benchmarks share (as numpy.testing is to numpy): tiny random models, fake
groups and learner configs, the scripted producer and learner processes, starting and probing a real buffer, and
in-process doubles of the buffer and of the producer worker's parts.

Product code never imports this package; it is here so that tests/ and bench/ need no `sys.path` edits and no
copies of each other's scaffolding.

    models.py     save_random_llama, save_sharpened_tiny
    learner.py    make_tiny_model, make_groups, save_groups / load_groups, poison, make_cfg, main_args
    scripted.py   the scripted producer and learner (`python -m pipeline.testing.scripted producer|learner ...`)
    processes.py  buffer_command, scripted_command, start, wait_for_buffer, buffer_metrics, send_shutdown, ...
    doubles.py    LearnerBuffer, ProducerBuffer (buffer doubles on real sockets), FakeEngine, FakePool, FakeClient
    realistic_model.py  the model of realistic shape (BPE tokenizer, chat template, tied embeddings), cached
    weight_member.py    a dist weight-group member process without vLLM (`python -m pipeline.testing.weight_member`)
"""
