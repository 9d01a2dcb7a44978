"""Serve's request router for attnserve replicas: requests go to replicas whose models are loaded.

A replica answers `/healthz` at once and loads its models behind `/readyz` (service/startup.py); until
then its model routes return 503 + Retry-After. With more than one replica (the CPU default runs two,
docs/decisions.md), Serve's default power-of-two router would send requests to a replica still loading
while another serves. This router reads each replica's `record_routing_stats()` (`{"ready": bool}`,
refreshed every `request_routing_stats_period_s`) and offers Serve the ready replicas, those with the
fewest requests it has in flight first; only while none is ready does it offer all of them (so `/healthz`
and `/readyz` answer during start-up). Set in the Serve config:

    request_router_config: {request_router_class: "service.routing:ReadyFirstRouter",
                            request_routing_stats_period_s: 1}
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica


class ReadyFirstRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self.in_flight: dict = {}  # replica id -> requests this router sent that have not completed

    def on_send_request(self, replica_id) -> None:
        super().on_send_request(replica_id)
        self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self.in_flight[replica_id] = max(0, self.in_flight.get(replica_id, 0) - 1)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ready = [r for r in candidate_replicas if (r.routing_stats or {}).get("ready")]
        pool = ready or candidate_replicas
        # fewest in flight from here first, ties at random: Serve's cached queue lengths go stale after ~10 s
        # idle, and a burst then probes every replica at once and sees the same lengths (64 streams at once
        # put 40 on one 32-slot replica and 24 on the other)
        pool = random.sample(pool, len(pool))
        pool.sort(key=lambda r: self.in_flight.get(r.replica_id, 0))
        return [[r] for r in pool]
