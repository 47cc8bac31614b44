"""The names and defaults of workload/ that flag tables show: the data sets (data.py registers
one under each name), the models (models.py builds one under each) and the SGD defaults
(training.py). Nothing here imports torch or scikit-learn, so `gossipcomp peer --help` loads
neither."""

from __future__ import annotations

DATASET_NAMES = ("digits", "wine", "breast-cancer", "iris", "pysource")
MODEL_NAMES = ("mlp", "wide-mlp", "cnn", "resmlp", "chartransformer")

#: SGD learning rate for the digits MLP (training.py's docstring says how it was chosen).
DEFAULT_LR = 0.1
#: SGD momentum; each peer keeps its own buffer.
DEFAULT_MOMENTUM = 0.9
#: Minibatch size per peer per local step.
DEFAULT_BATCH_SIZE = 32
