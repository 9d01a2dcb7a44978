"""Serve's request router for attnserve replicas: requests go to replicas whose models are loaded.

A replica answers `/healthz` at once and loads its models behind `/readyz` (service/startup.py); until
then its model routes return 503 + Retry-After. With more than one replica (the CPU default runs two,
docs/decisions.md), Serve's default power-of-two router would send requests to a replica still loading
while another serves. This router reads each replica's `record_routing_stats()` (`{"ready": bool}`,
refreshed every `request_routing_stats_period_s`) and offers Serve two random ready replicas, of which
Serve takes the one with the shorter queue; only while none is ready does it offer all of them (so
`/healthz` and `/readyz` answer during start-up). Set in the Serve config:

    request_router_config: {request_router_class: "service.routing:ReadyFirstRouter",
                            request_routing_stats_period_s: 1}
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class ReadyFirstRouter(RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ready = [r for r in candidate_replicas if (r.routing_stats or {}).get("ready")]
        pool = ready or candidate_replicas
        return [random.sample(pool, 2) if len(pool) > 2 else pool]
