"""Serve's request router for attnserve replicas: requests go to replicas whose models are loaded.

A replica answers `/healthz` at once and loads its models behind `/readyz` (503 until then), so Serve's
default power-of-two router would send requests to a replica still loading while another serves. This one
offers the replicas whose `record_routing_stats()` says ready, fewest requests in flight first; only while
none is ready, all of them (so `/healthz` and `/readyz` answer during start-up). Set in the Serve config:

    request_router_config: {request_router_class: "service.routing:ReadyFirstRouter",
                            request_routing_stats_period_s: 1}
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

ABANDONED_S = 30.0  # a request chosen for but not routed this long ago was cancelled while waiting


@dataclass
class _Placed:
    replica_id: object
    chosen_at: float
    routed: bool = False


class ReadyFirstRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self.placed: dict[str, _Placed] = {}  # request id -> where it is counted, until it completes
        self.swept_at = time.monotonic()

    @property
    def in_flight(self) -> Counter:
        """Replica id -> requests placed there that have not completed."""
        return Counter(p.replica_id for p in self.placed.values())

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        placed = self.placed.get(pending_request.metadata.internal_request_id)
        if placed is not None:
            placed.replica_id = replica_id  # its first rank may have been full: count it where it went
            placed.routed = True

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self.placed.pop(internal_request_id, None)

    def _sweep(self, now: float) -> None:
        """Uncount requests that were chosen for but never routed (cancelled while Serve waited for room)."""
        if now - self.swept_at < 1.0:
            return
        self.swept_at = now
        for rid in [rid for rid, p in self.placed.items() if not p.routed and now - p.chosen_at > ABANDONED_S]:
            del self.placed[rid]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ready = [r for r in candidate_replicas if (r.routing_stats or {}).get("ready")]
        pool = ready or candidate_replicas
        # fewest in flight from here first: Serve's cached queue lengths go stale when idle, and a burst
        # would see the same lengths everywhere. The request is counted on the first rank now, before
        # any await, so the next one of the burst already sees it.
        now = time.monotonic()
        self._sweep(now)
        rid = pending_request.metadata.internal_request_id if pending_request is not None else None
        self.placed.pop(rid, None)  # chosen again (no room at the first choice): ranked without its own count
        counts = self.in_flight
        # ties in a fixed order: light load stays on one replica, whose prefix cache then holds the
        # conversation so far and whose neighbour idles (its core is lent to the busy one's steps)
        pool = sorted(pool, key=lambda r: (counts[r.replica_id], str(r.replica_id)))
        if rid is not None and pool:
            self.placed[rid] = _Placed(pool[0].replica_id, now)
        return [[r] for r in pool]
