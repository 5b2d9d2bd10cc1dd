"""CacheTTL's estimator: online models of tool durations, η, T and costs, and the exact
TTL optimiser. A pure library (numpy, River, scikit-learn); it imports nothing else from
the project.
"""

from estimator.cost import CostModel
from estimator.durations import DurationModel
from estimator.hierarchy import Chain, DurationHierarchy, Level, Lookup
from estimator.models import Models, WorkloadStats
from estimator.policies import (
    DEFAULT_TTL_CAP_S,
    DEFAULT_TTL_SLACK,
    POLICIES,
    CachettlPolicy,
    ContinuumPolicy,
    Decision,
    FixedTtlPolicy,
    NoPinPolicy,
    RequestFacts,
    TtlPolicy,
    get_policy,
    register_policy,
)
from estimator.profiles import DEFAULT_PROFILE, PROFILES, HardwareProfile, get_profile
from estimator.signatures import SignatureRegistry, json_signature, shell_signature
from estimator.ttl import (
    best_ttl_mixture,
    best_ttl_sorted,
    exponential_ttl,
    mixture_cdf,
    optimal_ttl,
)
from estimator.workload import MemoryFactor, QueueDelay, RemainingTurns

__all__ = [
    "DEFAULT_PROFILE",
    "DEFAULT_TTL_CAP_S",
    "DEFAULT_TTL_SLACK",
    "POLICIES",
    "PROFILES",
    "CachettlPolicy",
    "Chain",
    "ContinuumPolicy",
    "CostModel",
    "Decision",
    "DurationHierarchy",
    "DurationModel",
    "FixedTtlPolicy",
    "HardwareProfile",
    "Level",
    "Lookup",
    "MemoryFactor",
    "Models",
    "NoPinPolicy",
    "QueueDelay",
    "RemainingTurns",
    "RequestFacts",
    "SignatureRegistry",
    "TtlPolicy",
    "WorkloadStats",
    "best_ttl_mixture",
    "best_ttl_sorted",
    "exponential_ttl",
    "get_policy",
    "get_profile",
    "json_signature",
    "mixture_cdf",
    "optimal_ttl",
    "register_policy",
    "shell_signature",
]
