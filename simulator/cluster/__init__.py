"""A cluster of simulated engines behind the field's routers (see simulator/README.md,
"Cluster").

==================== ==================================================================
router               mechanism
==================== ==================================================================
round_robin          vllm-router: the next worker in turn
power_of_two         vllm-router: two random workers, fewer pending requests
consistent_hash      vllm-router: session id on a ring of 160 virtual nodes per worker
sticky_least_loaded  vllm-router: new session to the fewest active sessions, then sticky
cache_aware          vllm-router: approximate prefix tree per worker (0.3 / 64 / 1.5)
program-scheduling   vllm-router program scheduling: home target, break-even TTL, hold
dynamo               Dynamo KV cost; hard or soft session affinity with an idle TTL
llm-d                llm-d EPP: session affinity 1 + prefix 3 + queue 2 scorers
sglang               SGLang gateway cache_aware with a 180 s TTL'd placement index
ttl-aware            ours: back to a live pin's holder unless waiting costs more
==================== ==================================================================
"""

from simulator.cluster import peers, progsched, ttlaware, vllm_router
from simulator.cluster.base import ROUTERS, TurnRequest, get_router
from simulator.cluster.cluster import Cluster, TopologyChange, simulate_cluster

__all__ = [
    "ROUTERS",
    "Cluster",
    "TopologyChange",
    "TurnRequest",
    "get_router",
    "peers",
    "progsched",
    "simulate_cluster",
    "ttlaware",
    "vllm_router",
]
