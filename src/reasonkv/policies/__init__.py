"""Token-importance policies (scorers) and the shared selection. Pure torch."""

from reasonkv.policies.base import EMPTY, Observation, Scorer
from reasonkv.policies.selection import protected_mask, select_tokens
from reasonkv.policies.snapkv import SnapKVScorer
from reasonkv.policies.streaming import StreamingScorer
from reasonkv.policies.tova import TOVAScorer

__all__ = [
    "EMPTY",
    "Observation",
    "Scorer",
    "SnapKVScorer",
    "StreamingScorer",
    "TOVAScorer",
    "protected_mask",
    "select_tokens",
]
