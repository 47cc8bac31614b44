"""What is trained: the digits data and its partitions (data.py), the small models
(models.py), minibatches and local SGD steps (training.py), and the atomic, digest-checked
checkpoint files that hold a peer's progress (checkpoint.py). Needs torch, no network."""
