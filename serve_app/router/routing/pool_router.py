"""The request router of a model pool's deployment: PoolView's placement over Serve's replicas,
through Serve's public request-router interface (`ray.serve.request_router`).

Serve runs one of these in each process that holds a handle to the pool (the routers); it sees
the batches that process sends. Serve's own multiplexed routing prefers a replica holding the
model and otherwise the one with fewest models, and never loads a busy model on a second replica
(ray-project/ray#48741); PoolView adds that rule (serve_app.scheduling.placement).
"""

from __future__ import annotations

import logging
import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from serve_app.scheduling.placement import PoolView

logger = logging.getLogger("ray.serve")


class PoolRouter(RequestRouter):
    def initialize_state(self, max_models: int = 4, busy_batches: int = 2, second_copies: bool = True, **kwargs: Any) -> None:
        self.view = PoolView(max_models, busy_batches, second_copies=second_copies)
        logger.info(
            "pool router: %d models a replica, a replica busy at %d batches, second copies %s",
            max_models, busy_batches, "on" if second_copies else "off",
        )  # fmt: skip
        self.model_of: dict[str, str] = {}  # Serve's internal request id -> its model, while in flight

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        model = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not model:  # a call for no model (stats, say): any replica, drawn at random
            return [[r] for r in random.sample(candidate_replicas, len(candidate_replicas))]
        self.view.set_replicas({r.replica_id.unique_id: r.multiplexed_model_ids for r in self.curr_replicas.values()})
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranks = [[by_id[i] for i in rank if i in by_id] for rank in self.view.choose(model, by_id).ranks]
        return [rank for rank in ranks if rank] or [candidate_replicas]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        model = pending_request.metadata.multiplexed_model_id
        if model:
            self.view.routed(replica_id.unique_id, model)
            self.model_of[pending_request.metadata.internal_request_id] = model

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        model = self.model_of.pop(internal_request_id, None)
        if model is not None:
            self.view.completed(replica_id.unique_id, model)
