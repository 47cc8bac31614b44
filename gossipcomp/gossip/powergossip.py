"""PowerGossip (Vogels, Karimireddy, Jaggi, NeurIPS 2020): low-rank gossip of model differences.

Per edge (i, j) and matrix parameter X ([m, n] after reshaping to [out, -1], transposed if
needed so that n <= m: the first step then acts on the smaller side), both ends hold the
same rank-r vector v, drawn at start from a seed hashed from (seed, min(i,j), max(i,j), index):
nothing is sent to agree on it. Power steps alternate sides:

- right step: q = orth(v) ([n, r]); send a_i = X_i q; receive a_j = X_j q, so a_j - a_i =
  (X_j - X_i) q; update X_i += gamma w_ij (a_j - a_i) q^T. The next (left) vector is
  a_low - a_high, oriented by peer id so both ends hold the same one (warm start).
- left step: p = orth(u) ([m, r]); send b_i = X_i^T p; update X_i += gamma w_ij p (b_j - b_i)^T;
  the next right vector is b_low - b_high.

Both ends apply equal and opposite updates, so the network sum of every parameter is preserved.
Tensors with ndim <= 1 (biases, norm weights) are gossiped exactly with the first step of a round.
A schedule's groups merge the payload: each group travels as one raw wire tensor holding its
matrices' products and (first step) its vectors' values, one after another in model order, instead
of one wire tensor per parameter; the arithmetic, and so the result, is the same.
A round sends r*m or r*n floats per matrix per edge instead of m*n; r is capped at n per
matrix, and with r = n one step averages two peers' matrices exactly. No matrix uses a rank above
`largest_useful_rank` (the longest short side): the command line refuses one.

A schedule may set a rank per link (`set_levels`, the rate controller's level: levels/rate.py).
Both ends switch at the same round; a link's vectors keep their first columns when its rank
falls, and gain columns drawn from a seed of (edge, matrix, side, round) when it rises, so both
ends still hold the same vectors without sending any. Each neighbour's envelopes then have
their own shapes (`link_specs`).

Bases are orthonormalised by Householder QR (`orthonormal_basis`), in compiled code: a step costs
O(m r^2) whatever r is. (A Gram-Schmidt loop in Python made each step cost O(r^2) interpreter
iterations: at r = 256, a quarter of a second per matrix per neighbour, so a large --rank, capped
to 256 on the demo's 256x256 layer, ran ten times slower than rank 1.)

Step k of the run (k = sweep * power_steps + s, the sweep being the round, or on a
time-varying graph the round // its period, so an edge active once a period alternates sides
and its warm start is used) is a right step when k is even. Its phase is
named "right{s}" or "left{s}", so both ends expect the same shapes. If an edge fails, neither
end's vector for that side advances; the next step of the other side uses its own last vector,
so the two ends stay in agreement when both see the failure. When an edge resumes after a
failure or a restart, both ends draw its vectors afresh from a seed that includes the resume
round: no data is needed to agree on them again.

With `clipping`, what a neighbour j contributes in one step (the low-rank updates of every
matrix, plus the exact differences of the vectors in step 0) is clipped as one vector to the
step's radius: its norm is that of the received differences, since the basis is orthonormal
(||D q^T|| = ||D||), so it is known before any update is formed; the update is then applied with
step gamma w_ij min(1, tau / d_j) (gossip/clipping.py). The warm-start vectors are unaffected.
Each power step is clipped on its own, so a round of `power_steps` steps moves a peer by at most
power_steps * gamma * sum_j w_ij * tau.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from gossipcomp.gossip.base import NamedParams, Neighbourhood
from gossipcomp.gossip.clipping import ClipRadius, clipped_weights, total_norm
from gossipcomp.gossip.grouping import group_name
from gossipcomp.gossip.linalg import hashed_seed, orthonormal_basis
from gossipcomp.gossip.specs import AUTO, BuildContext, Option, check_steps
from gossipcomp.gossip.state import checked_tensors, require_keys
from gossipcomp.inputs.numbers import checked_integer
from gossipcomp.levels.rate import LevelCosts, rank_ladder
from gossipcomp.schedule.groups import TensorGroup, check_cover
from gossipcomp.transport.base import Envelope, Payload, PayloadSpec, TensorSpec
from gossipcomp.transport.codec import decode_raw, encode_raw, raw_nbytes

RIGHT, LEFT = "right", "left"


def oriented(tensor: torch.Tensor) -> torch.Tensor:
    """A view of a parameter (ndim >= 2) as [m, n] with n <= m: [out, rest], or its transpose."""
    matrix = tensor.view(tensor.shape[0], -1)
    return matrix if matrix.shape[1] <= matrix.shape[0] else matrix.t()


def largest_useful_rank(params: Iterable[torch.Tensor]) -> int:
    """The highest rank any matrix among `params` can use: the longest of their short sides
    (each matrix caps the rank at its own short side n, where one step already averages it
    exactly). 0 when there is no matrix."""
    return max((min(oriented(p).shape) for p in params if p.ndim >= 2), default=0)


class PowerGossip:
    """Low-rank power-iteration gossip; exact gossip for vectors."""

    name = "powergossip"
    OPTIONS: ClassVar[dict[str, Option]] = {
        "rank": Option(int, 1, flag="rank"),
        "steps": Option(int, 1, flag="gossip_steps"),
        "gamma": Option(float, AUTO, auto=True, flag="consensus_step"),
    }

    @classmethod
    def from_options(cls, options: Mapping[str, Any], context: BuildContext) -> PowerGossip:
        return cls(
            rank=options["rank"],
            power_steps=check_steps(options["steps"]),
            consensus_step=context.step(options["gamma"]),
            seed=context.seed,
            clipping=context.clipping,
        )

    def __init__(
        self,
        rank: int = 1,
        power_steps: int = 1,
        consensus_step: float = 1.0,
        seed: int = 0,
        clipping: ClipRadius | None = None,
    ) -> None:
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        if power_steps < 1:
            raise ValueError(f"power_steps must be >= 1, got {power_steps}")
        if not 0.0 < consensus_step < 2.0:
            raise ValueError(f"consensus_step must lie in (0, 2), got {consensus_step}")
        self.rank = rank
        self.power_steps = power_steps
        self.consensus_step = consensus_step
        self.seed = seed
        self.clipping = clipping
        self._me = -1
        self._matrices: list[int] = []
        self._vectors: list[int] = []
        self._neighbours: list[int] = []
        self._link_ranks: dict[int, int] = {}  # neighbour -> the rank its edge uses
        self._shapes: dict[int, torch.Size] = {}
        self._device = torch.device("cpu")
        # (neighbour, parameter index, side) -> the side's current vector ([n, r] or [m, r])
        self._state: dict[tuple[int, int, str], torch.Tensor] = {}
        # per wire tensor of a phase: its name and the parameters it carries (schedule groups)
        self._layout: list[tuple[str, tuple[int, ...]]] = []

    def setup(
        self, params: NamedParams, rank: int, neighbours: Sequence[int]
    ) -> dict[str, PayloadSpec]:
        self._me = rank
        self._matrices = [i for i, (_, p) in enumerate(params) if p.ndim >= 2]
        self._vectors = [i for i, (_, p) in enumerate(params) if p.ndim <= 1]
        self._shapes = {i: oriented(params[i][1]).shape for i in self._matrices}
        self._neighbours = list(neighbours)
        self._link_ranks = {j: self.rank for j in neighbours}
        self._device = params[0][1].device
        for j in neighbours:
            self._draw_vectors(j)
        self._layout = self._layout_of(params, None)
        return self.specs(params, None)

    def _draw_vectors(self, neighbour: int, resume_round: int | None = None) -> None:
        """The edge's starting vectors, from a seed both ends compute alike (the resume round
        joins the seed when the edge resumes, so a resumed edge does not replay old vectors)."""
        low, high = min(self._me, neighbour), max(self._me, neighbour)
        for i in self._matrices:
            m, n = self._shapes[i]
            for side, rows in ((RIGHT, n), (LEFT, m)):
                parts: tuple[int | str, ...] = (self.seed, low, high, i, side)
                if resume_round is not None:
                    parts += ("resume", resume_round)
                g = torch.Generator().manual_seed(hashed_seed(*parts))
                rank = self._matrix_rank(i, self._link_ranks[neighbour])
                vector = torch.randn(rows, rank, generator=g, dtype=torch.float32)
                self._state[(neighbour, i, side)] = vector.to(self._device)

    def _matrix_rank(self, i: int, link_rank: int) -> int:
        """The rank matrix `i` uses on a link of rank `link_rank` (capped at its short side)."""
        return min(link_rank, *self._shapes[i])

    def level_costs(self, params: NamedParams) -> LevelCosts:
        """Ranks 1, 2, 4, ... up to the largest useful one, with the raw bytes one round sends
        one neighbour at each (rounds alternate which side goes first: the mean of both)."""
        ladder = rank_ladder(max(1, largest_useful_rank(p for _, p in params)))
        layout = self._layout_of(params, None)
        costs = {}
        for level in ladder:
            total = 0
            for first in (RIGHT, LEFT):
                for s in range(self.power_steps):
                    side = first if s % 2 == 0 else (LEFT if first == RIGHT else RIGHT)
                    spec = self._spec(params, layout, side, s == 0, level)
                    total += sum(t.nbytes for t in spec)
            costs[level] = max(1, total // 2)
        return LevelCosts(costs, self.power_steps)

    def level_label(self, level: int) -> str:
        return f"rank={level}"

    def _check_levels(self, params: NamedParams, levels: Mapping[int, int]) -> dict[int, int]:
        """Every neighbour's rank under `levels` (those not listed: the algorithm's own);
        ValueError for a neighbour this peer does not have or a rank it cannot use."""
        top = max(1, largest_useful_rank(p for _, p in params))
        ranks = {j: self.rank for j in self._neighbours}
        for j, level in levels.items():
            if j not in ranks:
                raise ValueError(f"link level for peer {j}, which is not a neighbour")
            ranks[j] = checked_integer(
                f"link level for peer {j} (a rank; {top}: the largest useful rank of this model)",
                level,
                1,
                top,
            )
        return ranks

    def link_specs(
        self,
        params: NamedParams,
        groups: Sequence[TensorGroup] | None,
        levels: Mapping[int, int],
    ) -> dict[str, Mapping[int, PayloadSpec] | PayloadSpec]:
        """Per phase, each neighbour's envelope under `groups` with ranks `levels`."""
        return self._specs_for(
            params, self._layout_of(params, groups), self._check_levels(params, levels)
        )

    def set_levels(self, levels: Mapping[int, int], round: int) -> None:
        """Use the ranks `levels` (neighbour -> rank; others: the algorithm's own) from
        `round` on; each edge's vectors are cut or grown alike at both ends."""
        ranks = {j: levels.get(j, self.rank) for j in self._neighbours}
        for j, rank in ranks.items():
            if rank == self._link_ranks[j]:
                continue
            low, high = min(self._me, j), max(self._me, j)
            for i in self._matrices:
                new = self._matrix_rank(i, rank)
                for side in (RIGHT, LEFT):
                    vector = self._state[(j, i, side)]
                    if new <= vector.shape[1]:
                        self._state[(j, i, side)] = vector[:, :new].contiguous()
                        continue
                    seed = hashed_seed(self.seed, low, high, i, side, "level", round)
                    g = torch.Generator().manual_seed(seed)
                    extra = torch.randn(
                        vector.shape[0], new - vector.shape[1], generator=g, dtype=torch.float32
                    )
                    self._state[(j, i, side)] = torch.cat([vector, extra.to(vector.device)], 1)
            self._link_ranks[j] = rank

    def resume_payload(self, params: NamedParams) -> Payload | None:
        return None  # the vectors are redrawn from a shared seed: nothing to send

    def resume_edge(self, neighbour: int, envelope: Envelope | None, round: int) -> None:
        self._draw_vectors(neighbour, round)

    def state_dict(self) -> dict[str, Any]:
        keys = sorted(self._state)
        return {
            "vector_keys": [f"{j}/{i}/{side}" for j, i, side in keys],
            "vectors": [self._state[k] for k in keys],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        require_keys(state, {"vector_keys", "vectors"}, self.name)
        keys = sorted(self._state)
        expected = [f"{j}/{i}/{side}" for j, i, side in keys]
        if list(state["vector_keys"]) != expected:
            raise ValueError(
                f"{self.name} state: vectors for {list(state['vector_keys'])[:4]}..., "
                f"expected {expected[:4]}... (another topology, rank or model?)"
            )
        restored = checked_tensors(
            f"{self.name} vectors", [self._state[k] for k in keys], state["vectors"]
        )
        self._state = dict(zip(keys, restored, strict=True))

    def specs(
        self, params: NamedParams, groups: Sequence[TensorGroup] | None
    ) -> dict[str, PayloadSpec]:
        """Per phase, what a neighbour's envelope holds when `groups` merge the payload (None
        or empty: one wire tensor per parameter); their compressor fields are not used."""
        return self._specs_for(params, self._layout_of(params, groups), self._link_ranks)

    def _specs_for(
        self,
        params: NamedParams,
        layout: list[tuple[str, tuple[int, ...]]],
        ranks: Mapping[int, int],
    ) -> dict[str, Mapping[int, PayloadSpec] | PayloadSpec]:
        """Per phase: one spec when every link has the same rank, else one per neighbour."""
        specs: dict[str, Mapping[int, PayloadSpec] | PayloadSpec] = {}
        for s in range(self.power_steps):
            for side in (RIGHT, LEFT):
                by_rank = {
                    r: self._spec(params, layout, side, s == 0, r) for r in set(ranks.values())
                }
                if len(by_rank) <= 1:
                    specs[f"{side}{s}"] = next(
                        iter(by_rank.values()), self._spec(params, layout, side, s == 0, self.rank)
                    )
                else:
                    specs[f"{side}{s}"] = {j: by_rank[r] for j, r in ranks.items()}
        return specs

    def regroup(self, params: NamedParams, groups: Sequence[TensorGroup] | None) -> None:
        """Merge the payload by `groups` from now on (the power vectors stay as they are)."""
        self._layout = self._layout_of(params, groups)

    @staticmethod
    def _layout_of(
        params: NamedParams, groups: Sequence[TensorGroup] | None
    ) -> list[tuple[str, tuple[int, ...]]]:
        """Per wire tensor: its name and the parameters (model order) it carries."""
        names = [name for name, _ in params]
        if not groups:
            return [(name, (i,)) for i, name in enumerate(names)]
        check_cover(groups, names, contiguous=False)
        position = {name: i for i, name in enumerate(names)}
        members = [tuple(sorted(position[n] for n in group.names)) for group in groups]
        return [(group_name([names[i] for i in m]), m) for m in members]

    def _sizes(
        self, params: NamedParams, members: tuple[int, ...], side: str, s: int, link_rank: int
    ) -> list[int]:
        """Elements each member puts in its group's wire tensor at step `s` of `side` on a
        link of rank `link_rank`: a matrix its product (rows x rank), a vector its values
        (step 0 only)."""
        sizes = []
        for i in members:
            if i in self._shapes:
                m, n = self._shapes[i]
                sizes.append((m if side == RIGHT else n) * self._matrix_rank(i, link_rank))
            else:
                sizes.append(params[i][1].numel() if s == 0 else 0)
        return sizes

    def _spec(
        self,
        params: NamedParams,
        layout: list[tuple[str, tuple[int, ...]]],
        side: str,
        with_vectors: bool,
        link_rank: int,
    ) -> PayloadSpec:
        specs: list[TensorSpec] = []
        for name, members in layout:
            count = sum(self._sizes(params, members, side, 0 if with_vectors else 1, link_rank))
            if count:
                shape = (count,)
                specs.append(
                    TensorSpec(
                        f"{name}/{side}", "float32", shape, "raw", raw_nbytes(torch.float32, shape)
                    )
                )
        return tuple(specs)

    def step(self, params: NamedParams, hood: Neighbourhood) -> None:
        for s in range(self.power_steps):
            k = hood.sweep * self.power_steps + s  # the side alternates between activations
            self._power_step(params, hood, RIGHT if k % 2 == 0 else LEFT, s)

    def _power_step(self, params: NamedParams, hood: Neighbourhood, side: str, s: int) -> None:
        with torch.no_grad():
            bases: dict[tuple[int, int], torch.Tensor] = {}
            mine: dict[tuple[int, int], torch.Tensor] = {}
            outgoing = {}
            for j in hood.neighbours:
                for i in self._matrices:
                    x = oriented(params[i][1]).float()
                    basis = orthonormal_basis(self._state[(j, i, side)])
                    product = x @ basis if side == RIGHT else x.t() @ basis
                    bases[(j, i)], mine[(j, i)] = basis, product
                tensors = []
                for name, members in self._layout:
                    pieces = [
                        mine[(j, i)].reshape(-1)
                        if i in self._shapes
                        else params[i][1].detach().float().reshape(-1)
                        for i in members
                        if i in self._shapes or s == 0
                    ]
                    if pieces:
                        tensors.append(encode_raw(f"{name}/{side}", torch.cat(pieces)))
                outgoing[j] = tuple(tensors)
            sent_vectors = (
                {i: params[i][1].detach().clone() for i in self._vectors} if s == 0 else {}
            )
            result = hood.exchange(f"{side}{s}", outgoing)
            other = LEFT if side == RIGHT else RIGHT
            # per neighbour: (X_j - X_i) applied to the basis for each matrix, and X_j - X_i for
            # each vector (step 0); all of them first, since clipping needs their norms
            differences: dict[int, list[torch.Tensor]] = {}
            vector_differences: dict[int, dict[int, torch.Tensor]] = {}
            for j, envelope in result.received.items():
                theirs = self._unpack(params, envelope, side, s, self._link_ranks[j])
                differences[j] = [
                    theirs[i].to(mine[(j, i)].device).view_as(mine[(j, i)]) - mine[(j, i)]
                    for i in self._matrices
                ]
                vector_differences[j] = {
                    i: theirs[i].to(params[i][1].device).view_as(sent_vectors[i]) - sent_vectors[i]
                    for i in sent_vectors
                }
            weights = {j: hood.weights[j] for j in result.received}
            if self.clipping is not None:
                distances = {
                    j: total_norm([*differences[j], *vector_differences[j].values()])
                    for j in weights
                }
                weights = clipped_weights(weights, distances, self.clipping)
            for j in result.received:
                step = self.consensus_step * weights.get(j, 0.0)  # 0: clipped to nothing
                for i, difference in zip(self._matrices, differences[j], strict=True):
                    if step:
                        x = oriented(params[i][1])
                        a, b = (
                            (difference, bases[(j, i)].t())
                            if side == RIGHT
                            else (bases[(j, i)], difference.t())
                        )
                        if x.dtype == a.dtype:  # x += step a b, fused: no update matrix made
                            x.addmm_(a, b, alpha=step)
                        else:
                            x.add_((a @ b).to(x.dtype), alpha=step)
                    # warm start: the next vector of the other side, the same at both ends
                    low_minus_high = -difference if self._me < j else difference
                    self._state[(j, i, other)] = low_minus_high
                for i, difference in vector_differences[j].items():
                    if step:
                        params[i][1].add_(difference, alpha=step)

    def _unpack(
        self, params: NamedParams, envelope: Envelope, side: str, s: int, link_rank: int
    ) -> dict[int, torch.Tensor]:
        """A neighbour's wire tensors (checked against the spec at receipt) split back into
        each parameter's piece, flat, by parameter index."""
        pieces: dict[int, torch.Tensor] = {}
        wire = iter(envelope.tensors)
        for _, members in self._layout:
            sizes = self._sizes(params, members, side, s, link_rank)
            if not sum(sizes):
                continue
            flat = decode_raw(next(wire))
            for i, piece in zip(members, flat.split(sizes), strict=True):
                if piece.numel():
                    pieces[i] = piece
        return pieces
