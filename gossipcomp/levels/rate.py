"""Bandwidth-adaptive compression: per link, the highest-fidelity level that fits a round budget.

Each link's speed is estimated from the transfers training already makes (no probing traffic),
as latency + bytes x seconds per byte. A send's time on a busy machine is mostly latency (CPU,
scheduling) that no level changes, with spells where a few sends take ten times as long, so:

- the latency is what the sends show does not grow with bytes: through the (lower) median
  time of each size sent at least three times, a robust slope, and the lowest of those times
  less its bytes' share (`separate_latency`), once the sizes lie 1.5x apart (a link that
  carried two levels, or PowerGossip's right and left steps on the wide MLP: 58 and 26 KB at
  rank 4). The controller keeps the last eight such latencies per link and their median stands
  in once the sends are all of one size again; a link never seen at two sizes, and a link's
  first decision, count none (bytes only: never overshoots);
- the seconds per byte are the lower median, over a direction's last `window` sends and over
  the last half of them, of what each send took beyond the latency, per byte; the slower of
  the two counts, so a link that slows down shows within three of four sends while one that
  speeds up must do so for the whole window, and a busy spell of a minority of sends is not a
  slow link;
- for going down, a send shows a per-byte cost only when it took longer than the latency by
  more than the sends' own noise (2.5x the median step between successive sends of a size,
  `send_noise`); one that did not counts 0 seconds per byte. A send of a few hundred bytes
  takes the latency plus noise, and that noise over so few bytes read as seconds per byte
  predicted every level, the current one included, over budget: the level stepped down, the
  next sends were smaller still and their reading noisier, to the bottom of the ladder
  (Choco's top-k on the shaped links of docs/benchmarks.md, run 5). Going up is still judged
  with every second beyond the latency counted as bytes: with the noise discounted there too,
  fast links rose until their bytes outgrew the noise (ranks 32-64 on a loaded machine, 10-15
  ms a round), which cost round time for no accuracy.

A level is a number on a ladder of one compressor family, from most compressed to none (for
PowerGossip the rank: 1, 2, 4, ... up to the rank that averages every matrix exactly). For each
level the algorithm states the bytes one round sends over a link and the exchanges it makes,
so the controller predicts a level's transfer time as exchanges x latency + bytes x seconds per
byte, and picks per link:

- the current level while its prediction lies within the budget and the next level up would
  not fit inside `raise_below` x the budget (the dead band between the two keeps levels from
  flapping);
- when the current level no longer fits, the highest level that does (the lowest when none);
- when the next level up fits inside `raise_below` x budget, that level: one step at a time,
  since a prediction far beyond the sizes the link has carried is an extrapolation, while
  going down goes as far as needed at once.

A level is also judged by what its rounds took (`measured_round`: the median of the link's last
half window of sends, made at that level): one whose rounds run over `MEASURED_OVER` x the
budget goes at least one level down, however well the model says it fits (after `lower_after`
decisions: half a window's median is one busy spell long). The model is fitted through a
link's sends at every size, and a link behind a token bucket with a short queue carries a
small payload at its rate but loses packets under a larger one: on a 4 Mbit/s tbf link of
benchmarks/adaptive.py the model put Choco's top-k 0.05 (34 KB) at 0.13 s, within a
0.13-0.14 s budget, while the median of its last sends took 0.15-0.18 s, and the level held
12-16 rounds after the change that slowed the link (docs/benchmarks.md, runs 9 and 10). The
drop goes as far as the measured rounds, scaled by bytes, say (`_measured_fit`: the model,
wrong about this link, cannot say how far; the scaling shrinks the latency too, so it never
goes further down than needed), and not where the noise-discounted estimate puts the level's
bytes within `LATENCY_BOUND_SHARE` of the budget (a round slow for reasons a lower level does
not change: a busy CPU, or a latency the link's sizes separated; a link that only ever carried
one size has no latency apart from its bytes, for this rule as for the model).

A level also fits when its bytes take at most a quarter of the time (`LATENCY_BOUND_SHARE`):
on a link whose latency alone leaves less than that, a lower level would shorten nothing but
the bytes, so a drop must come from time that grows with bytes. A proposal is taken once it
repeats (`raise_after`, `lower_after`), or at once going down from a level the whole window
(not a busy spell in its last sends) puts over `drop_at` x budget. A link lowered right after
it was raised (the estimate that raised it was noise) needs twice the patience to rise again,
up to `MAX_BACKOFF` times; a second raise in a row halves it, and so do `CALM_DECISIONS`
decisions without a change.

The budget is a round's local computation time (so communication hides behind it) unless set,
raised to the time the slowest link being decided takes at the lowest level when that is longer
(`round_budget`): no round can be shorter, so the other links may carry that much at no cost.
A link at the lowest level gives that time as measured (`measured_round`: the median of its
last half window of sends), not as modelled: behind a token bucket the smaller of PowerGossip's
two payloads passes at once, and a latency and bandwidth fitted through the two sizes put a
1 Mbit/s link's lowest level at a third of its real round (docs/benchmarks.md, e9). A link
above the lowest level gives at least its rounds as measured scaled to the lowest level's bytes
(`_floor_above`): when the slowest speed moves onto a link still at a higher level, the model
fitted through its window says fast, the budget fell to a third of the round, and fast links
dropped for it (docs/benchmarks.md, run 11). While that
floor sets the budget, every other link rises no higher than `drop_at` times the lowest level's
bytes (`ceiling_bytes`): bandwidth that moves can put the slowest link's speed on any edge, and
a level fitted to a fast link then costs up to its bytes over the lowest level's budgets a round
until the drop lands (rank 64 on an edge that fell to 4 Mbit/s: 240 ms a round against 36 ms);
within the ceiling it costs at most about `drop_at` budgets. Fidelity beyond it on fast links
is given up: on benchmarks/adaptive.py's model rank 4 reached 0.95 in 70 rounds, rank 16 in 76.
Pure arithmetic: no clock, no networking; the coordinator feeds it what peers report (its
first decision waits for round `FIRST_DECISION_ROUND`: start-up sends are slow), or without
one each edge's lower end its own sends (levels/edges.py).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from gossipcomp.inputs.numbers import checked_integer, checked_number
from gossipcomp.inputs.text import quoted
from gossipcomp.schedule.costs import LinkCost, check_sample, fit_line

MAX_LEVEL = 1 << 20  # a level (PowerGossip rank) beyond this is refused wherever it comes from
DEFAULT_WINDOW = 8  # sends per link the estimate is fitted on (and on the last half of them)
DEFAULT_RAISE_BELOW = 0.6  # a level goes up only when the higher one fits in 0.6 x budget
DEFAULT_RAISE_AFTER = 3  # decisions in a row proposing a higher level before it is taken
DEFAULT_LOWER_AFTER = 2  # and a lower one
DEFAULT_DROP_AT = 3.0  # a level predicted over 3 x budget goes down at once (noise: 2-3 x)
SEPARABLE_SPAN = 1.5  # sends whose sizes span this factor separate latency from bandwidth
SIZE_SENDS = 3  # sends of one size before its median time counts towards the latency
LATENCY_MEMORY = 8  # separated latencies per link whose median stands in for later ones
MAX_BACKOFF = 8  # at most 8 x raise_after decisions before a link that flapped rises again
CALM_DECISIONS = 2 * DEFAULT_WINDOW  # decisions without a change that halve a link's backoff
LATENCY_BOUND_SHARE = 0.25  # on a link slower than the budget whatever the size: bytes' share
FIRST_DECISION_ROUND = DEFAULT_WINDOW // 2  # rounds before a first decision (start-up is slow)
NOISE_STEPS = 2.5  # time beyond the latency within 2.5x a size's typical send-to-send step: noise
MEASURED_OVER = 1.1  # a level whose rounds as measured run over 1.1 x budget goes down

Link = tuple[int, int]  # (lower rank, higher rank)


def link(a: int, b: int) -> Link:
    """The key of the edge between peers `a` and `b`, whatever the order."""
    return (a, b) if a < b else (b, a)


def rank_ladder(largest_useful: int) -> tuple[int, ...]:
    """PowerGossip's levels: ranks 1, 2, 4, ... and, at the top, `largest_useful` (the rank at
    which one step averages every matrix exactly: no compression)."""
    if isinstance(largest_useful, bool) or not isinstance(largest_useful, int):
        raise ValueError(f"largest useful rank: expected an integer, got {quoted(largest_useful)}")
    if not 1 <= largest_useful <= MAX_LEVEL:
        raise ValueError(f"largest useful rank: expected 1 to {MAX_LEVEL}, got {largest_useful}")
    ranks = [1]
    while ranks[-1] * 2 < largest_useful:
        ranks.append(ranks[-1] * 2)
    if ranks[-1] != largest_useful:
        ranks.append(largest_useful)
    return tuple(ranks)


def peer_levels(
    links: Mapping[Link, int], neighbours: Mapping[int, Sequence[int]], default: int
) -> dict[int, int]:
    """The level of each peer of `neighbours` (peer -> its neighbours) when it broadcasts one
    payload to all of them (Choco-SGD, DEF-ATC): the lowest level among its links in `links`,
    a link not listed counting as `default`, so what it sends fits its slowest link. Every
    peer holding the same table computes the same levels for a sender, so a receiver knows the
    level a neighbour's payload was compressed at without being told."""
    return {
        peer: min((links.get(link(peer, j), default) for j in around), default=default)
        for peer, around in neighbours.items()
    }


def estimate_link(
    samples: Sequence[tuple[int, float]],
    window: int = DEFAULT_WINDOW,
    latency_s: float | None = None,
    *,
    settled: bool = False,
    bytes_only: bool = False,
    past_noise: bool = False,
) -> LinkCost:
    """Latency and seconds per byte of a link from its sends, oldest first: the slower of the
    estimates over the last `window` sends and over the last half of them, compared at their
    mean size. A link that slowed down shows within a few sends; one that sped up, only once
    the whole window agrees (`settled`: the whole window's estimate alone). The latency comes
    from every send given (`separate_latency`), or else `latency_s` (one separated before), or
    else 0 (and with `bytes_only`, always: every second counts as bytes, which never
    overshoots). With `past_noise`, a send that took no longer than the latency plus the sends'
    noise (`send_noise`) counts no cost per byte. ValueError when there is no send."""
    sends = checked_sends(samples)
    separated = None if bytes_only else separate_latency(sends)
    return _estimate(sends, separated, window, latency_s, settled, bytes_only, past_noise)


def checked_sends(samples: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """`samples` checked (`check_sample`: ValueError naming a bad one), those of no byte
    left out."""
    sends = [check_sample(nbytes, seconds, "link estimate") for nbytes, seconds in samples]
    return [(b, s) for b, s in sends if b > 0]


def _estimate(
    sends: Sequence[tuple[int, float]],
    separated: float | None,
    window: int,
    latency_s: float | None,
    settled: bool,
    bytes_only: bool,
    past_noise: bool,
) -> LinkCost:
    """`estimate_link` of checked `sends` whose latency `separate_latency` gave as
    `separated` (a decision estimates each direction three ways: it is separated once)."""
    recent = sends[-window:]
    if not recent:
        raise ValueError("link estimate: no send of at least one byte to estimate from")
    latency = 0.0 if bytes_only else separated
    if latency is None:
        latency = min(latency_s or 0.0, statistics.median(s for _, s in recent))
    noise = send_noise(recent) if past_noise else 0.0
    if settled:
        return _fit(recent, latency, noise)
    at = sum(b for b, _ in recent) / len(recent)
    fits = (_fit(recent, latency, noise), _fit(recent[-max(2, window // 2) :], latency, noise))
    return max(fits, key=lambda cost: cost.seconds(at))


def send_noise(sends: Sequence[tuple[int, float]]) -> float:
    """How much a send's time varies for reasons other than its size: `NOISE_STEPS` times
    the median difference between each send and the one before it of the same size (0 when
    there are fewer than `SIZE_SENDS` such steps: one step may be the link changing speed).
    Successive differences, so a link whose speed changed shows one
    large step, not a wide spread that would hide the change; a median, so a busy spell of
    a minority of sends does not widen it."""
    before: dict[int, float] = {}
    steps = []
    for nbytes, seconds in sends:
        if nbytes in before:
            steps.append(abs(seconds - before[nbytes]))
        before[nbytes] = seconds
    return NOISE_STEPS * statistics.median(steps) if len(steps) >= SIZE_SENDS else 0.0


def separate_latency(sends: Sequence[tuple[int, float]]) -> float | None:
    """The part of a send's time that does not grow with its size, when sizes sent at least
    `SIZE_SENDS` times lie `SEPARABLE_SPAN` apart: through the (lower) median time of each
    such size (through every send only when no size repeats so often; never through the
    first sends of a new level beside an old one: two sends of a new size, one held up by a
    busy CPU, made a slope that put the latency at 0 and every second on the bytes), a robust
    slope, and the lowest time less its bytes' share by that slope. Medians, as a busy CPU
    holds up a minority of sends whatever their size. None when the sizes lie closer (one
    level's payloads of near-equal sizes): noise would decide the slope."""
    by_size: dict[int, list[float]] = {}
    for nbytes, seconds in sends:
        by_size.setdefault(nbytes, []).append(seconds)
    medians = [(b, statistics.median_low(t)) for b, t in by_size.items() if len(t) >= SIZE_SENDS]
    points = medians or list(sends)
    sizes = [b for b, _ in points]
    if len(sizes) < 2 or max(sizes) < SEPARABLE_SPAN * min(sizes):
        return None
    _, per_byte = fit_line([float(b) for b in sizes], [t for _, t in points], "link estimate")
    return max(0.0, min(t - per_byte * b for b, t in points))


def _fit(sends: Sequence[tuple[int, float]], latency_s: float, noise_s: float = 0.0) -> LinkCost:
    """`latency_s` and the lower median over `sends` of the seconds per byte left after it:
    sends held up by a busy CPU are not a slow link unless they are most of them. A send that
    took at most `noise_s` beyond the latency shows no cost per byte (0): too small to show one."""
    per_byte = statistics.median_low(
        (s - latency_s) / b if s - latency_s > noise_s else 0.0 for b, s in sends
    )
    return LinkCost(latency_s, per_byte)


@dataclass(frozen=True)
class LevelCosts:
    """What one round sends over one link at each level of the ladder (ascending fidelity)."""

    bytes_per_round: Mapping[int, int]  # level -> bytes one round sends to one neighbour
    exchanges_per_round: int  # messages per round each way (each pays the latency)

    def __post_init__(self) -> None:
        if not self.bytes_per_round:
            raise ValueError("level costs: expected at least one level")
        for level, nbytes in self.bytes_per_round.items():
            checked_integer("level costs: level", level, 1, MAX_LEVEL)
            checked_integer("level costs: bytes", nbytes, 1, 1 << 40)
        checked_integer("level costs: exchanges per round", self.exchanges_per_round, 1, 1023)

    @property
    def levels(self) -> tuple[int, ...]:
        return tuple(sorted(self.bytes_per_round))

    def above(self, level: int) -> int:
        """The next level up the ladder (`level` itself at the top)."""
        return next((x for x in self.levels if x > level), level)

    def seconds(self, level: int, cost: LinkCost) -> float:
        """Predicted transfer time of one round at `level` over a link costing `cost`."""
        return (
            self.exchanges_per_round * cost.latency_s
            + self.bytes_per_round[level] * cost.seconds_per_byte
        )


class RateController:
    """Chooses each link's level from its estimated cost, with hysteresis (module docstring).
    Keeps, per link, the proposal that is repeating and how many times it has."""

    def __init__(
        self,
        costs: LevelCosts,
        *,
        raise_below: float = DEFAULT_RAISE_BELOW,
        raise_after: int = DEFAULT_RAISE_AFTER,
        lower_after: int = DEFAULT_LOWER_AFTER,
        drop_at: float = DEFAULT_DROP_AT,
    ) -> None:
        checked_number("raise_below", raise_below, 0.0, 1.0, closed_low=False)
        checked_integer("raise_after", raise_after, 1, 100)
        checked_integer("lower_after", lower_after, 1, 100)
        checked_number("drop_at", drop_at, 1.0)
        self.costs = costs
        self.raise_below = raise_below
        self.raise_after = raise_after
        self.lower_after = lower_after
        self.drop_at = drop_at
        self._streaks: dict[Link, tuple[int, int]] = {}  # link -> (proposed level, times)
        # link -> (its last change: +1 up, -1 down; the factor on raise_after, 1 to MAX_BACKOFF;
        # the decision it was taken at)
        self._changes: dict[Link, tuple[int, int, int]] = {}
        self._decisions = 0  # `update`s so far: the clock a backoff calms down by
        # link -> the latencies its sends separated at the last decisions that could
        self._latency: dict[Link, deque[float]] = {}
        self.budget_s: float | None = None  # the budget of the last `update` (`round_budget`)
        # each link's settled estimate at the last `update`, and the floor the budget took from
        # them (`round_budget`): what the coordinator logs of a decision
        self.estimated: dict[Link, LinkCost] = {}
        self.floor_s = 0.0
        self.floor_link: Link | None = None  # the link the floor was taken from
        self.ceiling_bytes: int | float | None = None  # the most a rising link may carry
        # the round as measured of each link at the lowest level at the last `update`
        self.measured: dict[Link, float] = {}
        # and of each link above it, at its level then (`_patient` lowers one over budget)
        self.measured_above: dict[Link, float] = {}

    def choose(
        self,
        current: int | None,
        cost: LinkCost,
        budget_s: float,
        lenient: LinkCost | None = None,
        ceiling_bytes: float | None = None,
    ) -> int:
        """The level proposed for a link now at `current` (None: not set yet) costing `cost`,
        when a round's transfers must fit `budget_s` seconds (no patience: `update` adds it).
        Going down is judged on `lenient` (default `cost`: the estimate whose sends' time within
        their noise counts no bytes), so only time that grows with bytes lowers a level; going
        up on `cost`, every second beyond the latency counted as bytes, so noise raises none,
        and never to a level of more than `ceiling_bytes` a round (None: no ceiling)."""
        if not (math.isfinite(budget_s) and budget_s > 0):
            raise ValueError(f"round budget: expected seconds > 0, got {budget_s}")
        lenient = cost if lenient is None else lenient
        levels = self.costs.levels
        allowed = [
            level
            for level in levels
            if ceiling_bytes is None or self.costs.bytes_per_round[level] <= ceiling_bytes
        ] or [levels[0]]
        fits = [level for level in allowed if self._fits(level, cost, budget_s)]
        best = fits[-1] if fits else levels[0]
        if current is None or current not in self.costs.bytes_per_round:
            return best
        if not self._fits(current, lenient, budget_s):  # too slow now: down, as far as needed
            return max((x for x in levels if self._fits(x, lenient, budget_s)), default=levels[0])
        higher = [level for level in allowed if level > current]
        if higher and self._fits(higher[0], cost, self.raise_below * budget_s):
            return higher[0]
        return current

    def _fits(self, level: int, cost: LinkCost, seconds: float) -> bool:
        """Whether a round at `level` fits `seconds`: its predicted transfers do, or, on a
        link whose latency leaves less than `LATENCY_BOUND_SHARE` of them, its bytes take at
        most that share (a lower level would not shorten the latency, only lose fidelity)."""
        latency = self.costs.exchanges_per_round * cost.latency_s
        bytes_s = self.costs.bytes_per_round[level] * cost.seconds_per_byte
        return latency + bytes_s <= seconds or bytes_s <= LATENCY_BOUND_SHARE * seconds

    def update(
        self,
        current: Mapping[Link, int],
        sends: Mapping[Link, Sequence[Sequence[tuple[int, float]]]],
        budget_s: float,
        top: int | None = None,
        floor_only: Collection[Link] = (),
    ) -> dict[Link, int]:
        """New levels for every link (those without sends to estimate from keep theirs).
        `sends[link]` holds each direction's sends, oldest first; a link is as slow as its
        slower direction. A link's first level (none yet, or one off the ladder) jumps to
        what fits with every second of its sends priced as bytes: it never overshoots. No
        link is proposed above `top` (None: the ladder's top), so no raise past it is counted
        or taken (a caller's ceiling: coordinator's hold, the training loss's allowance).
        Links in `floor_only` count towards the round's floor (`round_budget`) and nothing
        else: no proposal, no patience counted (a peer deciding alone: the edges the other
        end decides, and those whose decided change still waits for its round)."""
        self._decisions += 1
        chosen = dict(current)
        estimated: dict[Link, tuple[LinkCost, LinkCost, LinkCost]] = {}
        for key, directions in sends.items():
            first = current.get(key) not in self.costs.bytes_per_round
            estimates = self._estimates(key, directions, bytes_only=first)
            if not estimates:
                continue
            worst, settled, lenient = (
                LinkCost(max(e.latency_s for e in kind), max(e.seconds_per_byte for e in kind))
                for kind in zip(*estimates, strict=True)
            )
            estimated[key] = (worst, settled, lenient)
        self.estimated = {key: e[1] for key, e in estimated.items()}
        lowest = self.costs.levels[0]
        # the round as measured at each link's level: at the lowest, the floor's input; above
        # it, what `_patient` holds against the budget
        at_level = {
            key: seconds
            for key, directions in sends.items()
            if key in estimated
            and (seconds := self.measured_round(current.get(key), directions)) is not None
        }
        self.measured = {k: v for k, v in at_level.items() if current.get(k) == lowest}
        self.measured_above = {k: v for k, v in at_level.items() if current.get(k) != lowest}
        floors = {
            key: self.measured[key]
            if key in self.measured
            else self._floor_above(key, current.get(key), cost)
            for key, cost in self.estimated.items()
        }
        self.budget_s = self.round_budget(budget_s, floors)
        for key, (worst, settled, lenient) in estimated.items():
            if key in floor_only:
                continue
            chosen[key] = self._patient(
                key, current.get(key), worst, settled, self.budget_s, lenient, top
            )
        return chosen

    def measured_round(
        self, level: int | None, directions: Sequence[Sequence[tuple[int, float]]]
    ) -> float | None:
        """What a round at `level` took on a link, as measured: the median of the last half
        window of sends (the slower direction's) times the exchanges a round makes, when those
        sends were made at `level` (their mean size nearer its bytes than any other level's).
        None when no direction's recent sends were, or `level` is not on the ladder."""
        if level not in self.costs.bytes_per_round:
            return None
        exchanges = self.costs.exchanges_per_round
        found = []
        for samples in directions:
            try:
                recent = checked_sends(samples)[-max(2, DEFAULT_WINDOW // 2) :]
            except ValueError:  # a send out of range: this direction is not estimated either
                continue
            if len(recent) < 2:
                continue
            mean_bytes = exchanges * sum(b for b, _ in recent) / len(recent)
            if self._nearest_level(mean_bytes) == level:
                found.append(exchanges * statistics.median(s for _, s in recent))
        return max(found, default=None)

    def _floor_above(self, key: Link, level: int | None, cost: LinkCost) -> float:
        """A round at the lowest level on a link that is not there: the model's, or, when
        more, its rounds as measured at `level` scaled to the lowest level's bytes. The scaled
        time is below the lowest level's (its latency scaled down too), so it never raises
        the budget past what the link takes there; it keeps the floor where the link is when
        the model, fitted through a window of sends from before a slowdown, still says fast:
        the link the slowest speed moved onto, still at a higher level, while the one that
        was slowest, at the lowest level, measures fast (the budget fell to a third and fast
        links dropped for it, docs/benchmarks.md, run 11)."""
        modelled = self.costs.seconds(self.costs.levels[0], cost)
        measured = self.measured_above.get(key)  # only ever measured at a level on the ladder
        if measured is None or level is None:
            return modelled
        return max(modelled, self._scaled(measured, level, self.costs.levels[0]))

    def _scaled(self, seconds: float, level: int, to: int) -> float:
        """A round of `seconds` measured at `level`, scaled to level `to`'s bytes: a lower
        bound on a round there when `to` is lower (the latency shrinks with it)."""
        bytes_per_round = self.costs.bytes_per_round
        return seconds * bytes_per_round[to] / bytes_per_round[level]

    def _nearest_level(self, nbytes: float) -> int:
        """The level whose bytes a round lie nearest `nbytes`, by ratio."""
        return min(
            self.costs.levels,
            key=lambda level: abs(math.log(nbytes / self.costs.bytes_per_round[level])),
        )

    def round_budget(self, budget_s: float, floors: Mapping[Link, float]) -> float:
        """The budget levels are chosen within: `budget_s`, or, when the slowest link takes
        longer than that at the lowest level (`floors`: each link's time a round there), that
        time. A round waits for its slowest link (every peer for its neighbours), so it cannot
        be shorter, and a link that carries more in that time costs the round nothing: on a
        network slower than compute the budget follows the network, and every faster link
        rises beside the slowest one instead of all sinking to the lowest level. While that
        floor sets the budget, the other links rise no further than `ceiling_bytes`."""
        self.floor_s = max(floors.values(), default=0.0)
        self.floor_link = max(floors, key=floors.__getitem__) if floors else None
        self.ceiling_bytes = None
        if self.floor_s > budget_s:
            self.ceiling_bytes = self.drop_at * self.costs.bytes_per_round[self.costs.levels[0]]
        return max(budget_s, self.floor_s)

    def _estimates(
        self, key: Link, directions: Sequence[Sequence[tuple[int, float]]], bytes_only: bool
    ) -> list[tuple[LinkCost, LinkCost, LinkCost]]:
        """Each direction's estimate, its settled one and its lenient one (`estimate_link`,
        `past_noise`; directions without a send left out). The latency the sends separate is
        remembered per link (the slower direction's, at the last `LATENCY_MEMORY` decisions
        that separated one), and their median stands in while they no longer do: a link that
        stays at one level keeps what
        its earlier sizes showed, and one unlucky snapshot (a busy spell at one size) does
        not decide it."""
        memory = self._latency.setdefault(key, deque(maxlen=LATENCY_MEMORY))
        known = statistics.median(memory) if memory else None
        estimates, separated = [], []
        window = DEFAULT_WINDOW
        for samples in directions:
            try:
                sends = checked_sends(samples)
                latency = separate_latency(sends)
                estimates.append(
                    (
                        _estimate(sends, latency, window, known, False, bytes_only, False),
                        _estimate(sends, latency, window, known, True, False, False),
                        _estimate(sends, latency, window, known, False, bytes_only, True),
                    )
                )
            except ValueError:
                continue
            if latency is not None:
                separated.append(latency)
        if separated:
            memory.append(max(separated))
        return estimates

    def _patient(
        self,
        key: Link,
        current: int | None,
        cost: LinkCost,
        settled: LinkCost,
        budget_s: float,
        lenient: LinkCost,
        top: int | None = None,
    ) -> int:
        """`choose` (no higher than `top`), once the proposal has repeated enough (module
        docstring); at least one level down from a level whose rounds as measured run over
        `MEASURED_OVER` x the budget (`_measured_over`); at once when going down from a level whose `settled` estimate (the
        whole window: most of its sends, not a short busy spell) is over `drop_at` x budget.
        While the floor sets the budget, rising goes no higher than the ceiling
        (`round_budget`), and not at all on the link the
        floor came from: every round waits for that link, so any higher level of it would
        lengthen the round beyond the budget it set (with its floor as measured, the model's
        cost of a higher level could look cheap enough to take, and the next floor, from the
        model again, would then drop it back)."""
        ceiling = self.ceiling_bytes
        if ceiling is not None and key == self.floor_link and current in self.costs.bytes_per_round:
            ceiling = self.costs.bytes_per_round[current]
        if top in self.costs.bytes_per_round:
            top_bytes = self.costs.bytes_per_round[top]
            ceiling = top_bytes if ceiling is None else min(ceiling, top_bytes)
        proposal = self.choose(current, cost, budget_s, lenient, ceiling)
        measured = self.measured_above.get(key)  # only for a level on the ladder above the lowest
        if measured is not None and current is not None:
            if self._measured_over(current, measured, lenient, budget_s):
                proposal = min(proposal, self._measured_fit(current, measured, budget_s))
        if current is None or current not in self.costs.bytes_per_round or proposal == current:
            self._streaks.pop(key, None)
            return proposal
        if proposal < current and self.costs.seconds(current, settled) > self.drop_at * budget_s:
            return self._change(key, current, proposal)
        level, times = self._streaks.get(key, (proposal, 0))
        same_way = (level > current) == (proposal > current)
        times = times + 1 if same_way else 1
        needed = self.raise_after * self._backoff(key) if proposal > current else self.lower_after
        if times >= needed:
            return self._change(key, current, proposal)
        self._streaks[key] = (proposal, times)
        return current

    def _measured_over(
        self, current: int, measured: float, cost: LinkCost, budget_s: float
    ) -> bool:
        """Whether the rounds of a link above the lowest level, as measured (`measured`
        seconds), run over `MEASURED_OVER` x the budget while the bytes of its level take more
        than `LATENCY_BOUND_SHARE` of it by the lenient estimate (`cost`: the sends' time
        within their noise counts no bytes), so that a lower level shortens them: a busy
        spell in half the last sends lengthens the median round, not the bytes' share of
        the sends that are not held up (module docstring)."""
        bytes_s = self.costs.bytes_per_round[current] * cost.seconds_per_byte
        return measured > MEASURED_OVER * budget_s and bytes_s > LATENCY_BOUND_SHARE * budget_s

    def _measured_fit(self, current: int, measured: float, budget_s: float) -> int:
        """The highest level below `current` whose round, as measured at `current`
        (`measured` seconds) scaled by bytes, stays within `MEASURED_OVER` x the budget (the
        lowest when none does). The scaled time is a lower bound (the latency shrinks with
        it), so the drop stops at or above the level that fits: a link the slowest speed moved
        onto at level 4 goes straight to the lowest level its own floor set the budget by,
        where one level a decision took two changes and their margins."""
        below = [level for level in self.costs.levels if level < current]
        limit = MEASURED_OVER * budget_s
        fitting = [x for x in below if self._scaled(measured, current, x) <= limit]
        return fitting[-1] if fitting else below[0]

    def _backoff(self, key: Link) -> int:
        """The factor on `raise_after` a link's flaps earned (`_change`), halved for every
        `CALM_DECISIONS` decisions since its last change: a link lowered because the network
        moved, right after a raise, rises again at the usual pace once the network moves
        back (on benchmarks/adaptive.py's moving rates two such links were given rank 4 19 and
        24 rounds after the change that freed them, three without the backoff 11-15:
        docs/benchmarks.md, run 12), while one that flaps every few decisions keeps it."""
        _, backoff, at = self._changes.get(key, (0, 1, 0))
        halvings = min((self._decisions - at) // CALM_DECISIONS, MAX_BACKOFF.bit_length())
        return max(1, backoff >> halvings)

    def _change(self, key: Link, current: int, proposal: int) -> int:
        """Take `proposal`. A link lowered right after it was raised (the estimate that
        raised it was noise) needs twice the patience to rise again, up to `MAX_BACKOFF`
        times; one raised twice in a row, half of it again (`_backoff`: it calms down)."""
        self._streaks.pop(key, None)
        way = 1 if proposal > current else -1
        last = self._changes.get(key, (0, 1, 0))[0]
        backoff = self._backoff(key)
        if way < 0 and last > 0:
            backoff = min(MAX_BACKOFF, 2 * backoff)
        elif way > 0 and last > 0:
            backoff = max(1, backoff // 2)
        self._changes[key] = (way, backoff, self._decisions)
        return proposal
