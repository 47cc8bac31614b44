"""Which registered models can train on which registered data sets, checked by name before
anything is built, so that a mismatch is refused with a sentence rather than a shape error deep
in the first forward pass."""

from __future__ import annotations

from gossipcomp.workload.data import DATASETS, is_text, parse_partition
from gossipcomp.workload.models import LANGUAGE_MODELS


def check_pairing(model: str, dataset: str, partition: str = "iid") -> None:
    """Raise ValueError unless `model` reads what `dataset` holds (a language model text, the
    others rows of features; cnn the 8x8 digits alone) and `partition` can deal it."""
    text = is_text(dataset)
    text_sets = sorted(name for name in DATASETS if is_text(name))
    if model in LANGUAGE_MODELS and not text:
        raise ValueError(
            f"model {model} is a character-level language model; dataset {dataset} holds "
            f"labelled rows: expected a text dataset ({', '.join(text_sets)})"
        )
    if text and model not in LANGUAGE_MODELS:
        raise ValueError(
            f"dataset {dataset} is text (windows of character ids); model {model} reads rows of "
            f"features: expected a language model ({', '.join(sorted(LANGUAGE_MODELS))})"
        )
    if model == "cnn" and dataset != "digits":
        raise ValueError(
            f"model cnn reads the 8x8 digits images; dataset {dataset} is tabular: "
            "expected model mlp or resmlp"
        )
    kind = parse_partition(partition).kind
    if text and kind != "iid":
        raise ValueError(
            f"partition {partition}: dataset {dataset} is text, whose windows have no label to "
            "deal by; expected partition iid"
        )
