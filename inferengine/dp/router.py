"""`Router`: picks the replica for each request from what its KV cache holds and how loaded it is.

Each replica's prefix index is the set of block hashes its block pool holds, and the set its CPU
tier holds, replayed from the replica's KV events (stored, removed, cleared, per tier): never
guessed from past routing. Requests routed to a replica and not yet finished add their prompt's
hashes to its pool's set as well (their pages will be computed there before any later request
is scheduled), so a burst of requests sharing a prefix follows the first instead of spreading
before the first events arrive. As in the engine's lookup, a prompt's hits are the leading run
of blocks in the pool, then the run after it in the CPU tier (loaded back, not recomputed).

The cost of sending a request to a replica, in prompt tokens (policy "cache-aware"):

    (prompt tokens in neither tier) + cpu_hit_cost * (prompt tokens found in its CPU tier only)
        + load_cost_tokens * (requests in flight there) + kv_usage_cost_tokens * (KV usage)

and the cheapest replica wins (ties: fewer in flight, fewer served, lower id). Policy
"round-robin" takes the replicas that are up in turn, whatever they hold. A replica with
`balance_abs` more requests in flight than the least loaded one, and `balance_ratio` times as
many, is passed over whatever its cache holds. A request with a session key (`prompt_cache_key`)
goes where its session went, while that replica is up, under either policy (its leased pages
are there). Pure Python: every decision is exact.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from inferengine.config import EngineConfig
from inferengine.core.block_pool import (
    KV_CLEARED,
    KV_CPU_CLEARED,
    KV_CPU_REMOVED,
    KV_CPU_STORED,
    KV_REMOVED,
    KV_STORED,
    KVEvent,
)
from inferengine.core.hashing import BlockHash
from inferengine.errors import EngineDeadError

# Why a replica was picked (counted per reason), by policy.
POLICY_REASONS = {
    "cache-aware": ("session", "prefix", "load"),
    "round-robin": ("session", "round_robin"),
}


@dataclass
class RouterConfig:
    block_size: int = 16
    policy: str = "cache-aware"  # or "round-robin" (config.ROUTER_POLICIES)
    # What one more request in flight on a replica costs, in prompt tokens to compute.
    load_cost_tokens: float = 16.0
    # What a full KV cache costs (scaled by usage): its cached prefixes are about to go, and
    # new requests may preempt running ones.
    kv_usage_cost_tokens: float = 64.0
    # What a prompt token found only in the CPU tier costs, as a fraction of one to compute:
    # its page is copied back over the host link instead of being computed.
    cpu_hit_cost: float = 0.25
    # A replica this far above the least loaded one (in requests in flight, both conditions)
    # gets no new request unless its session is there.
    balance_abs: int = 32
    balance_ratio: float = 1.5
    max_sessions: int = 65536  # session -> replica entries kept (least recently used dropped)

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> RouterConfig:
        """The router of `serve --data-parallel-size N`: the `--router-*` flags given, the
        defaults above for the rest."""
        pc = config.parallel_config
        given = {
            "policy": pc.router_policy,
            "load_cost_tokens": pc.router_inflight_weight,
            "kv_usage_cost_tokens": pc.router_kv_usage_weight,
            "cpu_hit_cost": pc.router_cpu_hit_weight,
        }
        values = {k: v for k, v in given.items() if v is not None}
        return cls(block_size=config.cache_config.block_size, **values)


@dataclass
class ReplicaView:
    """What the router knows of one replica."""

    replica_id: int
    up: bool = True
    cached: set[BlockHash] = field(default_factory=set)  # replayed KV events: the GPU pool
    cpu_cached: set[BlockHash] = field(default_factory=set)  # and the CPU tier
    pending: Counter[BlockHash] = field(default_factory=Counter)  # hashes of requests in flight
    in_flight: int = 0  # requests routed here and not finished
    served: int = 0  # requests finished here
    num_running: int = 0  # as last reported
    num_waiting: int = 0
    kv_usage: float = 0.0

    def cached_prefix_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of a prompt (given by their hashes) this replica's pool holds or
        computes."""
        n = 0
        for h in hashes:
            if h not in self.cached and not self.pending[h]:
                break
            n += 1
        return n

    def hit_blocks(self, hashes: Sequence[BlockHash]) -> tuple[int, int]:
        """A prompt's hits as the engine finds them: (leading blocks in the pool or being
        computed, blocks continuing that run in the CPU tier)."""
        gpu = self.cached_prefix_blocks(hashes)
        cpu = 0
        for h in hashes[gpu:]:
            if h not in self.cpu_cached:
                break
            cpu += 1
        return gpu, cpu


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica_id: int
    reason: str  # one of POLICY_REASONS
    cached_tokens: int  # prompt tokens the replica holds (or is computing) already, either tier
    costs: tuple[float, ...]  # per replica (inf: down or passed over), for logs and tests
    cpu_cached_tokens: int = 0  # of `cached_tokens`, those found in its CPU tier only


@dataclass(slots=True)
class _Assignment:
    replica_id: int
    hashes: tuple[BlockHash, ...]


class Router:
    def __init__(self, num_replicas: int, config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self.replicas = [ReplicaView(i) for i in range(num_replicas)]
        self.sessions: OrderedDict[str, int] = OrderedDict()
        self.assigned: dict[str, _Assignment] = {}
        reasons = POLICY_REASONS[self.config.policy]
        self.decisions: Counter[str] = Counter(dict.fromkeys(reasons, 0))
        self.rerouted = 0  # requests sent elsewhere after their replica died
        self._turn = 0  # round-robin: the replica to try first next time

    # ---- decisions ---------------------------------------------------------------------

    def route(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        num_prompt_tokens: int,
        session: str | None = None,
        rerouted: bool = False,
        exclude: Collection[int] = (),
    ) -> RouteDecision:
        """Pick a replica for a request whose prompt's full blocks hash to `block_hashes` and
        record it as in flight there until `finish(request_id)`; never one in `exclude` (those
        that already failed this request)."""
        live = [r for r in self.replicas if r.up and r.replica_id not in exclude]
        if not live:
            raise EngineDeadError("no engine replica is up; retry shortly.")
        decision = self._session_decision(session, block_hashes, exclude)
        if decision is None and self.config.policy == "round-robin":
            decision = self._round_robin_decision(block_hashes, exclude)
        elif decision is None:
            costs = self._costs(live, block_hashes, num_prompt_tokens)
            best = min(
                (r for r in live if costs[r.replica_id] != float("inf")),
                key=lambda r: (costs[r.replica_id], r.in_flight, r.served, r.replica_id),
            )
            decision = self._decision(best, block_hashes, "prefix", tuple(costs))
        self._assign(request_id, decision.replica_id, block_hashes)
        if session is not None:
            self.sessions[session] = decision.replica_id
            self.sessions.move_to_end(session)
            while len(self.sessions) > self.config.max_sessions:
                self.sessions.popitem(last=False)
        self.decisions[decision.reason] += 1
        self.rerouted += rerouted
        return decision

    def _session_decision(
        self, session: str | None, block_hashes: Sequence[BlockHash], exclude: Collection[int]
    ) -> RouteDecision | None:
        if session is None or session not in self.sessions:
            return None
        replica = self.replicas[self.sessions[session]]
        if not replica.up or replica.replica_id in exclude:
            return None
        return self._decision(replica, block_hashes, "session", self._only(replica))

    def _round_robin_decision(
        self, block_hashes: Sequence[BlockHash], exclude: Collection[int]
    ) -> RouteDecision:
        """The next replica that is up, after the one picked last (whatever they hold)."""
        n = len(self.replicas)
        replicas = (self.replicas[(self._turn + i) % n] for i in range(n))
        replica = next(r for r in replicas if r.up and r.replica_id not in exclude)
        self._turn = (replica.replica_id + 1) % n
        return self._decision(replica, block_hashes, "round_robin", self._only(replica))

    def _only(self, replica: ReplicaView) -> tuple[float, ...]:
        """The costs of a decision that considered no other replica."""
        return tuple(0.0 if r is replica else float("inf") for r in self.replicas)

    def _decision(
        self,
        replica: ReplicaView,
        block_hashes: Sequence[BlockHash],
        reason: str,
        costs: tuple[float, ...],
    ) -> RouteDecision:
        """`reason` "prefix" becomes "load" when the replica holds none of the prompt."""
        gpu, cpu = replica.hit_blocks(block_hashes)
        if reason == "prefix" and not gpu + cpu:
            reason = "load"
        bs = self.config.block_size
        return RouteDecision(replica.replica_id, reason, (gpu + cpu) * bs, costs, cpu * bs)

    def _costs(
        self, live: list[ReplicaView], block_hashes: Sequence[BlockHash], num_prompt_tokens: int
    ) -> list[float]:
        c = self.config
        least = min(r.in_flight for r in live)
        costs = [float("inf")] * len(self.replicas)
        for r in live:
            over = r.in_flight - least
            if over > c.balance_abs and r.in_flight > c.balance_ratio * least:
                continue  # passed over: too far above the least loaded replica
            gpu, cpu = r.hit_blocks(block_hashes)
            uncached = num_prompt_tokens - (gpu + cpu) * c.block_size
            costs[r.replica_id] = (
                max(0, uncached)
                + c.cpu_hit_cost * cpu * c.block_size
                + c.load_cost_tokens * r.in_flight
                + c.kv_usage_cost_tokens * r.kv_usage
            )
        return costs

    def _assign(self, request_id: str, replica_id: int, hashes: Sequence[BlockHash]) -> None:
        replica = self.replicas[replica_id]
        replica.in_flight += 1
        replica.pending.update(hashes)
        self.assigned[request_id] = _Assignment(replica_id, tuple(hashes))

    def finish(self, request_id: str, served: bool = True) -> int | None:
        """The request left its replica (finished, aborted or lost); returns the replica."""
        assignment = self.assigned.pop(request_id, None)
        if assignment is None:
            return None
        replica = self.replicas[assignment.replica_id]
        replica.in_flight -= 1
        replica.served += served
        pending = replica.pending
        for h in assignment.hashes:
            pending[h] -= 1
            if pending[h] <= 0:
                del pending[h]
        return assignment.replica_id

    def replica_of(self, request_id: str) -> int | None:
        assignment = self.assigned.get(request_id)
        return assignment.replica_id if assignment is not None else None

    # ---- what the replicas report ------------------------------------------------------

    def apply_kv_events(self, replica_id: int, events: Iterable[KVEvent]) -> None:
        replica = self.replicas[replica_id]
        cached, cpu_cached = replica.cached, replica.cpu_cached
        for kind, block_hash in events:
            if kind == KV_STORED:
                cached.add(block_hash)
            elif kind == KV_REMOVED:
                cached.discard(block_hash)
            elif kind == KV_CPU_STORED:
                cpu_cached.add(block_hash)
            elif kind == KV_CPU_REMOVED:
                cpu_cached.discard(block_hash)
            elif kind == KV_CLEARED:
                cached.clear()
            elif kind == KV_CPU_CLEARED:
                cpu_cached.clear()

    def update_load(
        self, replica_id: int, num_running: int, num_waiting: int, kv_usage: float
    ) -> None:
        replica = self.replicas[replica_id]
        replica.num_running, replica.num_waiting = num_running, num_waiting
        replica.kv_usage = kv_usage

    def mark_down(self, replica_id: int) -> None:
        """The replica stopped: route nothing there; its cache is gone. (Its requests stay
        assigned until `finish`ed, so that its in-flight count stays exact.)"""
        replica = self.replicas[replica_id]
        replica.up = False
        replica.cached.clear()
        replica.cpu_cached.clear()
        replica.kv_usage = 0.0
        replica.num_running = replica.num_waiting = 0

    def mark_up(self, replica_id: int) -> None:
        """A (new) incarnation of the replica serves, with an empty cache."""
        replica = self.replicas[replica_id]
        replica.up = True
        replica.cached.clear()
        replica.cpu_cached.clear()

    @property
    def num_up(self) -> int:
        return sum(r.up for r in self.replicas)
