"""Sends too small to show a per-byte cost (levels/rate.py `send_noise`): a send of a few
hundred bytes takes the latency plus noise, and the noise read as seconds per byte predicted
every larger level far over budget, so Choco's top-k levels stepped down to the bottom of the
ladder on the shaped links of docs/benchmarks.md (run 5). Time within the sends' own noise
beyond the latency now shows no cost per byte."""

from __future__ import annotations

import random
import statistics

import pytest

from gossipcomp.levels.rate import (
    NOISE_STEPS,
    LevelCosts,
    RateController,
    estimate_link,
    send_noise,
)

# bytes per round of Choco's top-k ladder on the benchmark's mlp (1e-4 ... 0.5, identity)
BYTES = (104, 176, 352, 696, 1384, 3448, 6896, 13784, 34448, 68888, 137760, 340000)
LADDER = LevelCosts({level: n for level, n in enumerate(BYTES, start=1)}, exchanges_per_round=1)
KEY = (0, 1)
MBIT_4 = 8 / 4e6 * 1.05  # seconds per byte of TCP payload through a 4 Mbit/s tbf link


def test_noise_is_the_step_between_sends_of_one_size_not_a_change_of_size_or_speed() -> None:
    sends = [(104, 0.020), (104, 0.022), (104, 0.018), (104, 0.021)]
    sends += [(34_448, 0.092), (34_448, 0.094), (34_448, 0.090)]
    # steps between successive sends of a size: 0.002 0.004 0.003 | 0.002 0.004
    assert send_noise(sends) == pytest.approx(NOISE_STEPS * 0.003)
    assert send_noise([(104, 0.02), (104, 0.03), (200, 0.5), (200, 0.1)]) == 0.0  # 2 steps: unknown
    # a link that slowed tenfold at one size: one large step, not noise that hides it
    slowed = [(9_000, 0.010 + d) for d in (0, 0.001, 0, 0.001)] * 2
    slowed += [(9_000, 0.100 + d) for d in (0, 0.001, 0, 0.001)] * 2
    assert send_noise(slowed) == pytest.approx(NOISE_STEPS * 0.001)
    shown = estimate_link(slowed, past_noise=True).seconds_per_byte
    assert shown == pytest.approx(0.1 / 9_000, rel=0.02)


def test_a_few_hundred_bytes_within_the_noise_show_no_cost_per_byte() -> None:
    """Sends of 104 bytes, 18-26 ms, on a link whose latency (20 ms) an earlier level showed:
    the old estimate read 4 ms / 104 bytes (26 KB/s: 34 KB would take 1.3 s); none now."""
    sends = [(104, t) for t in (0.020, 0.024, 0.018, 0.026, 0.021, 0.023, 0.019, 0.025)]
    assert estimate_link(sends, latency_s=0.020, past_noise=True).seconds_per_byte == 0.0
    # without past_noise (how a rise is judged) the noise still counts as bytes
    assert estimate_link(sends, latency_s=0.020).seconds_per_byte > 0.0
    # bytes that take longer than the noise still count, in full
    big = [(34_448, 0.020 + 34_448 * MBIT_4 + d) for d in (0.0, 0.004, -0.002, 0.003) * 2]
    assert estimate_link(big, latency_s=0.020, past_noise=True).seconds_per_byte == pytest.approx(
        MBIT_4, rel=0.1
    )


def test_a_level_does_not_step_down_on_noise_to_the_bottom_of_the_ladder() -> None:
    """A controller at level 3 (352 bytes) on a fast link whose sends take 20 ms plus up to
    8 ms whatever their size, the latency known from larger sends, a 25 ms budget: the old
    estimate lowered it to level 1 within a few decisions (every level 'over budget'); the
    level now stays."""
    controller = RateController(LADDER)
    mixed = [(13_784, 0.021)] * 4 + [(352, 0.020)] * 4  # separates a 20 ms latency
    controller.update({KEY: 3}, {KEY: [mixed]}, 0.025)
    rng = random.Random(1)
    level = 3
    levels = []
    for _ in range(12):
        sends = [(BYTES[level - 1], 0.020 + rng.uniform(0.0, 0.008)) for _ in range(8)]
        level = controller.update({KEY: level}, {KEY: [sends]}, 0.025)[KEY]
        levels.append(level)
    assert min(levels) >= 3, levels


def _run(per_byte: float, seed: int, decisions: int = 60) -> list[int]:
    """Levels after each decision of a controller from level 9 (top-k 0.05) on a link of
    20 ms + up to 10 ms of noise, one send in eight held up 200 ms more, plus `per_byte`; a
    25 ms budget (what the slowest link takes at the lowest level)."""
    controller, rng = RateController(LADDER), random.Random(seed)

    def seconds(nbytes: int) -> float:
        spike = 0.2 if rng.random() < 1 / 8 else 0.0
        return 0.02 + rng.uniform(0.0, 0.01) + spike + nbytes * per_byte

    sends = [(BYTES[7], seconds(BYTES[7])) for _ in range(4)]
    level, levels = 9, []
    for _ in range(decisions):
        sends += [(BYTES[level - 1], seconds(BYTES[level - 1])) for _ in range(2)]
        level = controller.update({KEY: level}, {KEY: [sends[-16:]]}, 0.025)[KEY]
        levels.append(level)
    return levels


def test_on_a_4_mbit_link_levels_settle_where_the_bytes_put_them_not_at_the_bottom() -> None:
    """Level 5 (1.4 KB, 3 ms of bytes) is the highest whose bytes fit the 25 ms budget beside
    its latency. Over 20 such links, decisions 20-60: the old estimate held a fifth of them at
    levels 1-2 (7 of 20 links ended there); now a twentieth at most, at most one at the end, and
    the median is 5 or 6."""
    runs = [_run(MBIT_4, seed) for seed in range(20)]
    later = [level for levels in runs for level in levels[20:]]
    assert sum(level <= 2 for level in later) <= 0.05 * len(later)
    assert sum(levels[-1] <= 2 for levels in runs) <= 1
    assert 5 <= statistics.median(later) <= 6  # 6: 7 ms of bytes, within the sends' noise
