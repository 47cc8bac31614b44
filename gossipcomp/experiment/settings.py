"""TrainSettings: the settings of a training run and their defaults, as fields only.

TrainConfig (config.py) is these fields, each checked when a config is made, which needs the
registries of algorithms, models and planners (and torch). The command line's flag tables read
the defaults here, so `gossipcomp peer --help` loads none of that.
"""

from __future__ import annotations

from dataclasses import dataclass

from gossipcomp.gossip.catalog import DEFAULT_SCALE
from gossipcomp.peer.failures import DEFAULT_MAX_FAILED_ROUNDS
from gossipcomp.workload.catalog import DEFAULT_BATCH_SIZE, DEFAULT_LR, DEFAULT_MOMENTUM

# an SGD rate this large diverges at once (TrainingDiverged, tests/test_simulate.py); far above
# it, torch cannot apply the step to float32 parameters at all (1e308: an overflow error)
MAX_LR = 1e6
MAX_SEED = 2**32 - 1  # the data split's seed (scikit-learn, numpy) must fit 32 bits
MAX_LOCAL_STEPS = 10**6  # local steps between gossip rounds; more is a run without gossip


@dataclass(frozen=True)
class TrainSettings:
    """The fields of TrainConfig and their defaults, unchecked: build a TrainConfig to run."""

    # a name from gossipcomp.gossip.ALGORITHMS, whose options come from the fields below, or a
    # whole spec such as "choco:compressor=sign,steps=4,gamma=0.7" (gossip/specs.py)
    algorithm: str = "powergossip"
    model: str = "mlp"  # a name from gossipcomp.workload.models.MODELS
    dataset: str = "digits"  # a name from gossipcomp.workload.data.DATASETS
    rounds: int = 600  # local steps; a gossip round follows every `local_steps` of them
    lr: float = DEFAULT_LR  # SGD learning rate
    momentum: float = DEFAULT_MOMENTUM  # SGD momentum (each peer keeps its own buffer)
    batch_size: int = DEFAULT_BATCH_SIZE  # examples per local step
    partition: str = "iid"  # iid | by-label | dirichlet:ALPHA
    seed: int = 0  # data split, model init (identical on all peers) and batch order
    consensus_step: float | str | None = None  # gossip step; "auto"; None: the algorithm's default
    compressor: str | None = None  # compressor spec for choco and def, e.g. "topk:ratio=0.01"
    rank: int = 1  # powergossip: rank of the power iteration
    gossip_steps: int = 1  # exchanges per round: powergossip's power steps, choco's steps
    zeta: float | None = None  # def: damping of the differential update (None: per compressor)
    gamma: float | None = None  # def: mixing weight of the combine step (None: per compressor)
    eval_every: int = 50  # rounds between test-accuracy checkpoints (0: only at the end)
    round_timeout: float = 30.0  # seconds a round may wait for its neighbours
    clip: str | None = None  # clipped gossip: "adaptive", "adaptive:B", a radius; None: plain
    byzantine: tuple[int, ...] = ()  # ranks that lie (robustness experiments)
    attack: str = "sign_flip"  # what they send: a name from gossipcomp.gossip.ATTACKS
    attack_scale: float = DEFAULT_SCALE  # sign_flip sends -scale x, scale sends scale x
    # tensor groups for choco and def: "per-tensor", "single" or a planner spec (static plan)
    schedule: str = "per-tensor"
    # floating-point buffers (BatchNorm's running statistics) gossiped with the parameters
    gossip_buffers: bool = True
    local_steps: int = 1  # local optimizer steps between gossip rounds (local SGD)
    # rounds in a row without hearing any neighbour before a peer stops (0: never)
    max_failed_rounds: int = DEFAULT_MAX_FAILED_ROUNDS
    # outer optimizer after each gossip round (outer/optimizers.py), e.g.
    # "nesterov:lr=0.7,momentum=0.9"; None: the mixed model as it is (plain local SGD)
    outer: str | None = None
    drift: str = "none"  # drift correction of local steps: "none" or "tracking[:rate=R]"
