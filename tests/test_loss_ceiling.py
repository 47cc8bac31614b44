"""Link levels follow the training loss (AdaComm's rule carried to ranks, levels/progress.py).

The peer's loss window, the coordinator's allowance (grows only, the median over the members so
one peer's word cannot raise it), the ceiling it puts on the rate controller's levels (a rung
at a time as the loss falls), the checks on the reported losses, the flags, and a real
`simulate` whose trainer reports the losses the ceiling is taken from.
"""

from __future__ import annotations

import json
import logging
import math
import re

import grpc
import pytest
from conftest import in_memory_trainers, run_in_threads
from helpers import ladder_report

from gossipcomp.cli import build_parser, main
from gossipcomp.cli.coordinator import make_coordinator
from gossipcomp.cli.peer import _peer_levels as peer_peer_levels
from gossipcomp.cli.simulate import _peer_levels as simulate_peer_levels
from gossipcomp.coordinator import Coordinator, ReportRefused
from gossipcomp.experiment import TrainConfig
from gossipcomp.experiment.simulation import PeerLevels
from gossipcomp.levels.edges import LocalRateControl
from gossipcomp.levels.progress import LossAllowance, LossWindow
from gossipcomp.levels.rate import LevelCosts
from gossipcomp.proto.v1 import coordinator_pb2 as cpb
from gossipcomp.topology import build_topology
from gossipcomp.transport.memory import InMemoryHub

RING4 = build_topology("ring", n=4)
LADDER = LevelCosts({1: 1_000, 2: 2_000, 4: 4_000, 8: 8_000, 16: 16_000}, exchanges_per_round=1)
LINKS = [(0, 1), (0, 3), (1, 2), (2, 3)]


def test_the_window_keeps_the_first_steps_loss_and_the_mean_of_the_last_rounds():
    window = LossWindow(rounds=3)
    assert (window.initial, window.recent) == (0.0, 0.0)
    window.end_round()  # a round without local steps (a peer awaiting admission): nothing
    assert window.initial == 0.0
    rounds = ([2.0, 4.0, 3.0, 3.0, 0.0, 0.0], [2.0], [1.0], [0.5], [math.nan, -1.0, 2e6])
    for step_losses in rounds:
        for loss in step_losses:
            window.observe(loss)
        window.end_round()
    assert window.initial == 3.0  # the first round's first 4 steps: the untrained model's
    assert window.recent == pytest.approx((2.0 + 1.0 + 0.5) / 3)  # the last 3 rounds with steps


def test_a_window_survives_its_state_dict_and_a_malformed_one_changes_nothing():
    window = LossWindow(rounds=3)
    for loss in (2.0, 1.0, 0.5, 0.25):
        window.observe(loss)
        window.end_round()
    copy = LossWindow(rounds=3)
    copy.load_state_dict(window.state_dict())
    assert (copy.initial, copy.recent) == (window.initial, window.recent) == (2.0, 7 / 12)
    for bad, message in [
        ({"initial": 2.0}, "expected keys"),
        ({"initial": 2.0, "rounds": [1.0] * 4}, "at most 3 losses"),
        ({"initial": math.nan, "rounds": []}, "initial: expected a finite number"),
        ({"initial": 2.0, "rounds": [1.0, -1.0]}, "rounds' loss: expected a finite number"),
    ]:
        with pytest.raises(ValueError, match=message):
            copy.load_state_dict(bad)
        assert (copy.initial, copy.recent) == (2.0, 7 / 12)


@pytest.mark.parametrize(
    ("ratio", "level"), [(1.0, 1), (3.99, 1), (4.0, 2), (15.9, 2), (16.0, 4), (1e6, 16)]
)
def test_each_rung_up_the_ladder_needs_another_fourfold_fall_of_the_loss(ratio, level):
    """Rank (a rung's doubling) grows as sqrt(F_0 / F_t): rung k needs a fall of 4^k, and the
    top of the ladder caps it."""
    allowance = LossAllowance()
    allowance.update([(2.0, 2.0 / ratio)], members=1)
    assert allowance.highest(LADDER) == level


def test_the_allowance_only_grows_and_waits_for_a_majority():
    allowance = LossAllowance()
    allowance.update([(2.0, 0.5), (2.0, 0.5)], members=4)  # two of four: not a majority
    assert not allowance.measured and allowance.ratio == 1.0
    allowance.update([(2.0, 0.5)] * 3, members=4)
    assert allowance.measured and allowance.ratio == 4.0
    allowance.update([(2.0, 1.5), (2.0, 1.8), (2.0, 2.2)], members=4)  # noise, or a rise
    assert allowance.ratio == 4.0


@pytest.mark.parametrize(
    "forged",
    [(1e6, 1e-9), (2.0, 1e-9), (1e6, 2.0), (1e6, 5e-324)],
    ids=["both", "recent", "first", "subnormal"],
)
@pytest.mark.parametrize("honest", [1, 3])
def test_one_peer_claiming_a_huge_fall_does_not_raise_the_allowance(forged, honest):
    """The attack: a forged report's losses (a ratio up to overflow) beside honest peers whose
    loss has not fallen, one of them (two members: the lower median of the first losses over
    the upper median of the recent ones takes the honest side) or three."""
    allowance = LossAllowance()
    allowance.update([forged, *[(2.0, 2.0)] * honest], members=honest + 1)
    assert allowance.ratio == 1.0 and allowance.highest(LADDER) == 1


def test_an_overflowing_fall_is_bounded_and_allows_the_top():
    allowance = LossAllowance()
    allowance.update([(1e6, 5e-324)], members=1)  # a network of one, lying to itself
    assert math.isfinite(allowance.ratio) and allowance.highest(LADDER) == 16


def _report(
    sender: int, round: int, loss: float, initial: float = 2.0, critical: bool = False
) -> cpb.PeerReport:
    """A ring4 peer's report (helpers.ladder_report: level 8 fits a 10 ms budget) with its
    training losses."""
    return ladder_report(RING4, sender, round, initial_loss=initial, loss=loss, critical=critical)


def _levels(coordinator: Coordinator) -> dict[tuple[int, int], int]:
    return {(x.low, x.high): x.level for x in coordinator.published[-1].links}


def test_links_start_at_the_lowest_level_and_rise_a_rung_at_a_time_as_the_loss_falls(caplog):
    """The budget allows level 8 from the first decision (tests/test_adaptive.py); while the
    loss has not fallen every link stays at 1. A fourfold fall allows 2, a sixteenfold 4: the
    links rise to the ceiling by the controller's own steps (it is told the ceiling's level is
    in force, so each rung waits for its repeated proposals) and never above it, and a loss
    that rises again lowers nothing."""
    coordinator = Coordinator(RING4, report_every=1, adaptive=True, round_budget=0.01)
    schedule = [(r, 2.0, 1) for r in range(4, 10)] + [(r, 0.5, 2) for r in range(10, 16)]
    schedule += [(r, 0.125, 4) for r in range(16, 26)] + [(r, 1.9, 4) for r in range(26, 30)]
    seen = []
    with caplog.at_level(logging.INFO, logger="gossipcomp.coordinator.levels"):
        for round, loss, ceiling in schedule:
            for rank in range(4):
                coordinator.receive(_report(rank, round, loss))
            levels = set(_levels(coordinator).values())
            assert max(levels) <= ceiling, (round, levels)
            seen.append((round, levels))
    assert dict(seen)[9] == {1} and dict(seen)[15] == {2}
    assert dict(seen)[25] == dict(seen)[29] == {4}  # at the ceiling, and kept when loss rises
    lines = [r.getMessage() for r in caplog.records if r.name == "gossipcomp.coordinator.levels"]
    assert "(at most level 1: the training loss fell 1.00x)" in lines[0]
    assert any("(at most level 2: the training loss fell 4.00x)" in line for line in lines)
    assert "(at most level 4: the training loss fell 16.00x)" in lines[-1]


def test_a_forged_loss_from_one_peer_raises_no_link():
    """One peer of four reports a fall from 1e6 to 1e-9 every decision; the others' loss has
    not fallen."""
    coordinator = Coordinator(RING4, report_every=1, adaptive=True, round_budget=0.01)
    for round in range(4, 12):
        for rank in range(4):
            forged = rank == 0
            report = _report(rank, round, 1e-9 if forged else 2.0, 1e6 if forged else 2.0)
            coordinator.receive(report)
    assert _levels(coordinator) == dict.fromkeys(LINKS, 1)


def test_a_peer_reporting_no_loss_does_not_lift_the_ceiling():
    """One peer of four reports none (a joiner's reports before its first round, a liar): the
    three others decide, and the ceiling holds."""
    coordinator = Coordinator(RING4, report_every=1, adaptive=True, round_budget=0.01)
    for round in range(4, 12):
        for rank in range(4):
            coordinator.receive(_report(rank, round, 0.0 if rank == 0 else 2.0))
    assert _levels(coordinator) == dict.fromkeys(LINKS, 1)


def test_a_boosted_peer_goes_one_rung_above_the_ceiling_and_a_hold_goes_first():
    """With `boost` a critical peer's links go one rung above the loss's ceiling; with a
    hold the lowest level rules until the hold's round, and the loss's ceiling after it."""
    boosted = Coordinator(RING4, report_every=1, adaptive=True, round_budget=0.01, boost=True)
    for rank in range(4):
        boosted.receive(_report(rank, 4, 2.0, critical=rank == 2))
    assert _levels(boosted) == {(0, 1): 1, (0, 3): 1, (1, 2): 2, (2, 3): 2}
    held = Coordinator(RING4, report_every=1, adaptive=True, round_budget=0.01, hold_lowest_until=8)
    levels = {}
    for round in range(4, 20):
        for rank in range(4):
            held.receive(_report(rank, round, 0.5))  # a fourfold fall from the start: rung 1
        levels[round] = set(_levels(held).values())
    assert all(levels[r] == {1} for r in range(4, 8))
    assert levels[19] == {2}


def test_without_losses_the_budget_alone_decides_and_the_coordinator_says_so_once(caplog):
    """A loop of one's own that never calls observe_loss: the ceiling cannot apply, levels are
    the budget's (8), and one warning names the peers that report no loss."""
    coordinator = Coordinator(RING4, report_every=1, adaptive=True, round_budget=0.01)
    with caplog.at_level(logging.WARNING, logger="gossipcomp.coordinator"):
        for round in (4, 5, 6):
            for rank in range(4):
                coordinator.receive(_report(rank, round, 0.0, initial=0.0))
    assert _levels(coordinator) == dict.fromkeys(LINKS, 8)
    warnings = [r.getMessage() for r in caplog.records if "not capped" in r.getMessage()]
    assert len(warnings) == 1
    assert "peers 0, 1, 2, 3 (of 4) report none" in warnings[0]


def test_follow_loss_off_lets_the_budget_decide_alone():
    coordinator = Coordinator(
        RING4, report_every=1, adaptive=True, round_budget=0.01, follow_loss=False
    )
    for rank in range(4):
        coordinator.receive(_report(rank, 4, 2.0))
    assert _levels(coordinator) == dict.fromkeys(LINKS, 8)


@pytest.mark.parametrize("field", ["loss", "initial_loss"])
@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, 1e7])
def test_a_loss_out_of_range_is_refused_naming_the_field(field, value):
    coordinator = Coordinator(RING4, report_every=1, adaptive=True)
    report = _report(0, 4, 1.0)
    setattr(report, field, value)
    with pytest.raises(ReportRefused, match=f"^{field}: expected a finite number") as refused:
        coordinator.receive(report)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert not coordinator.published  # nothing of the refused report was taken


def test_the_command_line_turns_the_ceiling_off_only_with_adaptive(capsys):
    parse = build_parser("coordinator").parse_args
    on = parse(["coordinator", "--topology", "ring4", "--adaptive"])
    off = parse(["coordinator", "--topology", "ring4", "--adaptive", "--no-follow-loss"])
    assert make_coordinator(on, RING4).follow_loss
    assert not make_coordinator(off, RING4).follow_loss
    with pytest.raises(ValueError, match="--no-follow-loss: expected --adaptive"):
        make_coordinator(parse(["coordinator", "--topology", "ring4", "--no-follow-loss"]), RING4)
    # levels set by the peers follow the loss too: the flag reaches them, and needs --adaptive
    alone = ["--topology", "ring4", "--adaptive", "--no-coordinator"]
    assert simulate_peer_levels(build_parser("simulate").parse_args(["simulate", *alone])) == (
        PeerLevels(None, follow_loss=True)
    )
    unfollowed = build_parser("simulate").parse_args(["simulate", *alone, "--no-follow-loss"])
    assert simulate_peer_levels(unfollowed) == PeerLevels(None, follow_loss=False)
    peer = ["peer", "--topology", "ring4", "--rank", "0", "--no-follow-loss"]
    assert not peer_peer_levels(build_parser("peer").parse_args([*peer, "--adaptive"])).follow_loss
    assert main([*peer, "--rounds", "1"]) == 2
    assert "--no-follow-loss: expected --adaptive with it" in capsys.readouterr().err


def test_a_peer_deciding_levels_caps_them_at_its_own_losss_rung():
    """Without a coordinator the deciding end caps its levels at the rung its own loss's fall
    allows: none before a loss is noted (the budget alone), a rung per fourfold fall that only
    grows, a level above the ceiling (the algorithm's own at the start) brought down to it,
    and nothing with `follow_loss` off."""
    sends = [[(1_000, 1e-4), (16_000, 1e-3)] * 4]  # every level fits a budget of 1 s
    control = LocalRateControl(LADDER, 1.0)
    assert control.ceiling() is None
    assert control.choose_all({(0, 1): None}, {(0, 1): sends}, 1.0) == {(0, 1): 16}  # a jump
    control.note_loss(0.0, 1.0)  # not measured yet: nothing changes
    assert control.ceiling() is None
    control.note_loss(2.0, 2.0)
    assert control.ceiling() == 1
    assert control.choose_all({(0, 1): 16}, {(0, 1): sends}, 1.0) == {(0, 1): 1}  # comes down
    control.note_loss(8.0, 1.0)  # 8x: still the first rung up
    assert control.ceiling() == 2
    control.note_loss(16.0, 1.0)
    control.note_loss(16.0, 15.0)  # the loss rose again: the allowance does not fall
    assert control.ceiling() == 4
    for bad in (math.nan, math.inf, -1.0, 2e6):  # a loop of one's own passing a bad loss
        with pytest.raises(ValueError, match="^initial loss: expected a finite number"):
            control.note_loss(bad, 1.0)
        with pytest.raises(ValueError, match="^recent loss: expected a finite number"):
            control.note_loss(1.0, bad)
    assert control.ceiling() == 4
    off = LocalRateControl(LADDER, 1.0, follow_loss=False)
    off.note_loss(8.0, 1.0)
    off.note_loss(math.nan, 1.0)  # not following the loss: nothing is read
    assert off.ceiling() is None
    assert off.choose_all({(0, 1): None}, {(0, 1): sends}, 1.0) == {(0, 1): 16}


def test_simulate_reports_the_training_loss_and_no_link_rises_above_its_ceiling(tmp_path, caplog):
    """A real `simulate` with an adaptive coordinator and a budget every level fits: the
    trainer's losses reach the coordinator, which starts every link at rank 1 and lets them
    rise to rank 2 once the loss fell fourfold (about round 35 here), never above the
    ceiling of the decision that published a level, and not to rank 4 (a 16-fold fall)."""
    path = tmp_path / "report.json"
    argv = ["--topology", "ring4", "--adaptive", "--report-every", "1", "--round-budget", "100"]
    argv += ["--rounds", "50", "--lr", "0.1", "--workers", "1", "--eval-every", "0"]
    argv += ["--report", str(path)]
    with caplog.at_level(logging.INFO, logger="gossipcomp.coordinator"):
        assert main(["simulate", "--quiet", *argv]) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "gossipcomp.coordinator.levels"]
    assert lines, "no decision of levels"
    assert not any("not capped" in r.getMessage() for r in caplog.records)
    falls, ceilings = [], []
    for line in lines:
        found = re.search(r"at most level (\d+): the training loss fell ([\d.]+)x", line)
        assert found, line
        levels = [int(x) for x in re.findall(r"\d-\d level (\d+)", line)]
        assert levels and max(levels) <= int(found[1]), line
        ceilings.append(int(found[1]))
        falls.append(float(found[2]))
    assert ceilings[0] == 1 and falls[-1] >= 4.0, falls  # the lowest first; rank 2 allowed
    report = json.loads(path.read_text())
    in_force = {int(c["level"].removeprefix("rank=")) for c in report["link_levels"]}
    assert max(in_force) == max(ceilings) == 2, (in_force, ceilings)  # every level fits 100 s
    assert report["mismatched_epoch_exchanges"] == 0


def test_a_restored_peer_reports_the_loss_it_started_from_not_its_trained_one(tmp_path, one_thread):
    """The window is in the trainer's checkpoint: a peer restored at round 6 reports the first
    round's loss it measured then (a fresh window would report the trained model's loss as
    its start, and hold every link at the lowest level for the rest of the run); a checkpoint
    from before losses were kept restores with none measured (not counted by the coordinator)."""
    config = TrainConfig(algorithm="dpsgd", rounds=6, eval_every=6, lr=0.1)
    trainers = in_memory_trainers(RING4, config, InMemoryHub(), tmp_path, every=6)
    for trainer in trainers:
        trainer.peer.start(7, {})
    run_in_threads([t.run for t in trainers])
    first, recent = trainers[0].losses.initial, trainers[0].losses.recent
    assert first > recent > 0
    restored = in_memory_trainers(RING4, config, InMemoryHub(), tmp_path, every=6)[0]
    assert restored.restore() == 6
    assert (restored.losses.initial, restored.losses.recent) == (first, recent)
    path = restored.store.path_for(6)
    state = restored.state_dict()
    del state["losses"]
    restored.store.save(6, state)  # as an older version wrote it
    older = in_memory_trainers(RING4, config, InMemoryHub(), tmp_path, every=6)[0]
    assert older.restore() == 6 and path.exists()
    assert (older.losses.initial, older.losses.recent) == (0.0, 0.0)
