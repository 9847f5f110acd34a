"""Token-importance policies (scorers) and the shared selection. Pure torch."""

from reasonkv.policies.base import EMPTY, Observation, Scorer
from reasonkv.policies.beacon import BeaconKVScorer
from reasonkv.policies.h2o import H2OScorer
from reasonkv.policies.rkv import RKVScorer
from reasonkv.policies.rpc import RPCScorer
from reasonkv.policies.selection import protected_mask, select_tokens
from reasonkv.policies.snapkv import SnapKVScorer
from reasonkv.policies.streaming import StreamingScorer
from reasonkv.policies.tova import TOVAScorer

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
