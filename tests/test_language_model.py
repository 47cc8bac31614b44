"""The character-level language model workload (issue 26): the pysource corpus (the Python
standard library's own source), the chartransformer model, validation loss and perplexity in the
reports, and four peers over real gRPC that train it together, not each alone.

A transformer's peers once trained alone, silently: its -inf mask buffer made every exchange
fail. Here the mask is a non-persistent boolean buffer, never gossiped, and the peers' exchanges
are counted."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import benchmark

from gossipcomp.allreduce.train import MODELS as ALLREDUCE_MODELS
from gossipcomp.allreduce.train import AllreduceConfig
from gossipcomp.cli import main
from gossipcomp.experiment import TrainConfig
from gossipcomp.workload.data import is_text, load_split, parse_partition, partition_indices
from gossipcomp.workload.models import (
    build_model,
    constant_tensors,
    gossiped_tensors,
    model_signature,
)
from gossipcomp.workload.text import (
    CHARACTERS,
    UNKNOWN,
    VOCABULARY_SIZE,
    encode,
    python_source_windows,
    stdlib_sources,
)
from gossipcomp.workload.training import evaluate

# a small run: 4 peers x STEPS steps of BATCH windows of 64 characters (about 40 s of CPU); the
# rate is the largest of 0.3, 0.5, 1.0 with which one model alone did not diverge (momentum 0.9)
STEPS, BATCH, LR = 120, 8, 0.3


@pytest.fixture(scope="module")
def data():
    return load_split("pysource", seed=0)


def test_corpus_is_deterministic_and_split_by_file_without_overlap(data):
    again = load_split("pysource", seed=0)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(data, name), getattr(again, name)), name
    assert is_text("pysource") and data.vocabulary == VOCABULARY_SIZE == data.num_classes
    assert data.x_train.dtype == torch.int64 and data.num_features == 64
    for x, y in ((data.x_train, data.y_train), (data.x_test, data.y_test)):
        assert x.shape == y.shape and 0 <= int(x.min()) and int(x.max()) < VOCABULARY_SIZE
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets: the next character of each input
    train, test = python_source_windows(seed=0, test_fraction=0.2)
    train_files, test_files = set(train.files.tolist()), set(test.files.tolist())
    assert train_files and test_files and not train_files & test_files
    assert len(test_files) / (len(train_files) + len(test_files)) == pytest.approx(0.2, abs=0.05)
    other = python_source_windows(seed=1, test_fraction=0.2)[1]
    assert set(other.files.tolist()) != test_files  # the seed picks the held-out files
    assert len(train_files | test_files) <= len(stdlib_sources())


def test_bytes_map_to_a_fixed_vocabulary():
    assert encode(b"a\n\xff\x00").tolist() == [CHARACTERS.index(b"a"), CHARACTERS.index(b"\n")] + [
        UNKNOWN,
        UNKNOWN,
    ]
    assert VOCABULARY_SIZE == 101  # the 100 printable ASCII characters and one for the rest


def test_mask_is_causal():
    model = build_model("chartransformer", 0, 64, VOCABULARY_SIZE).eval()
    ids = torch.randint(0, VOCABULARY_SIZE, (2, 64), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[:, 40] = (changed[:, 40] + 1) % VOCABULARY_SIZE
    with torch.no_grad():
        before, after = model(ids), model(changed)
    assert before.shape == (2, 64, VOCABULARY_SIZE)
    assert torch.equal(before[:, :40], after[:, :40])  # no position sees a later one
    assert not torch.allclose(before[:, 40:], after[:, 40:])


def test_model_is_built_from_the_seed_and_never_gossips_its_mask():
    model, again = (build_model("chartransformer", 5, 64, VOCABULARY_SIZE) for _ in range(2))
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    masks = [name for name, _ in model.named_buffers() if name.endswith("mask")]
    assert len(masks) == 2  # one a block
    assert not set(masks) & set(model.state_dict())  # non-persistent: never checkpointed
    gossiped = [name for name, _ in gossiped_tensors(model)]
    assert gossiped == [name for name, _ in model.named_parameters()]
    assert constant_tensors(model) == []
    assert 20_000 < sum(p.numel() for p in model.parameters()) < 100_000
    # tied: the output layer is the token embedding, one tensor
    assert sum(1 for name in gossiped if "embed" in name) == 1
    assert model_signature(model) == model_signature(again)


def _unigram_loss(data) -> float:
    counts = torch.bincount(data.y_train.reshape(-1), minlength=VOCABULARY_SIZE).double() + 1.0
    return float(-(counts / counts.sum())[data.y_test.reshape(-1)].log().mean())


@pytest.mark.timeout(300)
def test_four_peers_over_grpc_train_it_together_with_powergossip_rank_1(data, one_thread):
    """benchmarks/language_model.py in a tiny configuration: 4 peers on ring4 (simulate, over
    gRPC on loopback) and one model alone on all the data, as many steps each."""
    reports, alone = benchmark("language_model").compare(
        STEPS, BATCH, LR, 0, {"PowerGossip r1": "powergossip:rank=1"}
    )
    report = reports["PowerGossip r1"]
    initial = evaluate(
        build_model("chartransformer", 0, data.num_features, data.num_classes),
        data.x_test,
        data.y_test,
    )[1]
    unigram = _unigram_loss(data)
    assert initial == pytest.approx(math.log(VOCABULARY_SIZE), abs=0.1)  # near uniform
    # every peer heard its neighbours every round: none trained alone
    for peer in report.per_peer:
        assert peer.failed_exchanges == 0 and peer.bytes_received > 0, peer
        assert peer.gossip_rounds == STEPS and peer.test_loss is not None
    loss = report.final_test_loss
    assert loss is not None and report.average_model_test_loss is not None
    assert loss < unigram - 0.2, (loss, unigram)
    # no worse than one model alone on all the data for as many steps (the four, mixing
    # four batches a step, usually do better)
    assert loss < alone.test_loss + 0.1, (loss, alone)
    assert report.average_model_test_loss < unigram - 0.2
    assert report.final_test_perplexity == pytest.approx(math.exp(loss))
    losses = [point.mean_test_loss for point in report.history]
    assert [point.round for point in report.history] == [STEPS // 4 * k for k in (1, 2, 3, 4)]
    assert losses[-1] == pytest.approx(loss) and losses[-1] < losses[0], losses
    assert "test loss" in str(report.summary_table().caption)


@pytest.mark.timeout(300)
def test_the_outer_grid_runs_tiny_on_the_language_model(one_thread):
    """benchmarks/language_model.py --outer-grid in a tiny configuration (H = 2, 4 steps of 4
    windows): a record per configuration of benchmarks/outer.py's grid, each with a validation
    loss or the reason it diverged, and one gossip round every 2 steps."""
    lm = benchmark("language_model")
    runs = lm.outer_grid(4, 4, LR, 0, (2,))
    labels = [r["label"] for r in runs]
    assert len(labels) == 6 and len(set(labels)) == 6 and all("H=2" in x for x in labels)
    for run in runs:
        assert run["local_steps"] == 2
        if run.get("error") is None:
            assert run["gossip_rounds"] == 2 and run["bytes"] > 0
            assert run["failed_exchanges"] == 0
            assert run["test_loss"] > 0 and math.isfinite(run["test_loss"]), run
    assert any(r.get("error") is None for r in runs)
    assert lm.grid_table(runs).row_count == 6


@pytest.mark.parametrize(
    "model, dataset, partition, message",
    [
        ("mlp", "pysource", "iid", "dataset pysource is text"),
        ("cnn", "pysource", "iid", "dataset pysource is text"),
        ("chartransformer", "digits", "iid", "model chartransformer is a character-level"),
        ("chartransformer", "wine", "iid", "expected a text dataset (pysource)"),
        ("chartransformer", "pysource", "by-label", "no label to deal by"),
        ("chartransformer", "pysource", "dirichlet:0.5", "expected partition iid"),
    ],
)
def test_mismatched_model_and_dataset_are_refused(model, dataset, partition, message, capsys):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(model=model, dataset=dataset, partition=partition)
    argv = ["simulate", "--quiet", "--rounds", "1", "--model", model, "--dataset", dataset]
    assert main([*argv, "--partition", partition]) == 2
    assert message in capsys.readouterr().err


def test_text_windows_deal_only_iid(data):
    targets = data.y_train.numpy()
    parts = partition_indices(targets, 4, parse_partition("iid"), seed=0)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(targets.shape[0]))
    with pytest.raises(ValueError, match="one label per example"):
        partition_indices(targets, 4, parse_partition("by-label"), seed=0)


def test_model_refuses_features_instead_of_character_ids():
    model = build_model("chartransformer", 0, 64, VOCABULARY_SIZE)
    with pytest.raises(ValueError, match="expected a text data set"):
        model(torch.zeros(3, 64))
    with pytest.raises(ValueError, match="at most 64"):
        model(torch.zeros(3, 65, dtype=torch.int64))


@pytest.mark.parametrize(
    "model, dataset, message, said",
    [
        ("chartransformer", "digits", "model chartransformer is a character-level", None),
        ("mlp", "pysource", "dataset pysource is text", None),
        ("resmlp-wide", "pysource", "dataset pysource is text", None),
        ("mlp", "wine", "dataset 'wine': expected one of digits, pysource", "invalid choice"),
    ],
)
def test_allreduce_refuses_mismatched_model_and_dataset(model, dataset, message, said, capsys):
    """Refused before any process starts (`said`: the command line's own words, if others)."""
    with pytest.raises(ValueError, match=message):
        AllreduceConfig(model=model, dataset=dataset)
    argv = ["allreduce", "--nproc", "2", "--steps", "1", "--model", model, "--dataset", dataset]
    assert main(argv) == 2
    assert (said or message) in capsys.readouterr().err


def test_allreduce_builds_the_language_model_for_its_corpus(data):
    model = ALLREDUCE_MODELS["chartransformer"](0)
    logits = model(data.x_test[:2])
    assert logits.shape == (2, data.num_features, data.num_classes)
    AllreduceConfig(model="chartransformer", dataset="pysource")  # a valid pair
