"""The policy math, pure torch: the contract, scorers, schedules, allocators and the shared selection."""

from reasonkv.core.policy.base import EMPTY, Observation
from reasonkv.core.policy.contract import HeadAllocator, LayerView, PolicyState, Scorer, SplitRequest
from reasonkv.core.policy.scorers.all_queries import AllQueriesScorer
from reasonkv.core.policy.scorers.beacon import BeaconKVScorer
from reasonkv.core.policy.scorers.h2o import H2OScorer
from reasonkv.core.policy.scorers.initial_recent import InitialRecentScorer
from reasonkv.core.policy.scorers.random import RandomScorer
from reasonkv.core.policy.scorers.recent_query import RecentQueryScorer
from reasonkv.core.policy.scorers.rkv import RKVScorer
from reasonkv.core.policy.scorers.rpc import RPCScorer
from reasonkv.core.policy.scorers.snapkv import SnapKVScorer
from reasonkv.core.policy.scorers.streaming import StreamingScorer
from reasonkv.core.policy.scorers.tova import TOVAScorer
from reasonkv.core.policy.selection import protected_mask, select_tokens

__all__ = [
    "AllQueriesScorer",
    "BeaconKVScorer",
    "EMPTY",
    "H2OScorer",
    "HeadAllocator",
    "InitialRecentScorer",
    "LayerView",
    "Observation",
    "PolicyState",
    "RKVScorer",
    "RPCScorer",
    "RandomScorer",
    "RecentQueryScorer",
    "Scorer",
    "SnapKVScorer",
    "SplitRequest",
    "StreamingScorer",
    "TOVAScorer",
    "protected_mask",
    "select_tokens",
]
