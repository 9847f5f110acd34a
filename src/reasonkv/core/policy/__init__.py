"""Token-importance policies (scorers) and the shared selection. Pure torch."""

from reasonkv.core.policy.base import EMPTY, Observation, Scorer
from reasonkv.core.policy.scorers.beacon import BeaconKVScorer
from reasonkv.core.policy.scorers.h2o import H2OScorer
from reasonkv.core.policy.scorers.rkv import RKVScorer
from reasonkv.core.policy.scorers.rpc import RPCScorer
from reasonkv.core.policy.scorers.snapkv import SnapKVScorer
from reasonkv.core.policy.scorers.streaming import StreamingScorer
from reasonkv.core.policy.scorers.tova import TOVAScorer
from reasonkv.core.policy.selection import protected_mask, select_tokens

__all__ = [
    "BeaconKVScorer",
    "EMPTY",
    "H2OScorer",
    "Observation",
    "RKVScorer",
    "RPCScorer",
    "Scorer",
    "SnapKVScorer",
    "StreamingScorer",
    "TOVAScorer",
    "protected_mask",
    "select_tokens",
]
