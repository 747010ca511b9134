"""`PDPolicy`: picks the prefill engine and the decode engine of each disaggregated request.

Prefill engines are chosen as the data-parallel `Router` chooses replicas (same cost model, same
prefix index): each prefill engine's index is replayed from the KV events it serves at
`GET /kv_events` (`core/kv_event_log.py`), and a prompt's block hashes are computed here from its
token ids with the engine's own scheme (`core/hashing.hash_prompt_blocks`, the engine's block
size and the request's `cache_salt`). The prefill engine that already holds the longest prefix,
net of its load, wins. Decode engines hold no shared prefix worth chasing (the prompt's pages
arrive from the prefill engine), so the one with the fewest requests in flight wins, then the
one with the fewest tokens in flight (prompt plus the tokens the request may generate). Pure
Python, no I/O: the HTTP side is `entrypoints/router/`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from inferengine.core.block_pool import KVEvent
from inferengine.core.hashing import BlockHash, hash_prompt_blocks
from inferengine.dp.router import RouteDecision, Router, RouterConfig
from inferengine.errors import EngineDeadError


@dataclass
class PDPolicyConfig:
    # The prefill engines' cost model (`dp/router.py`); its block size is replaced by the one
    # the engines report with their KV events.
    prefill: RouterConfig = field(default_factory=RouterConfig)


@dataclass(slots=True)
class DecodeView:
    """What the policy knows of one decode engine."""

    engine_id: int
    up: bool = True
    in_flight: int = 0  # requests sent there, not finished
    in_flight_tokens: int = 0  # their prompt tokens plus the tokens they may generate
    served: int = 0


class PDPolicy:
    def __init__(self, num_prefill: int, num_decode: int, config: PDPolicyConfig | None = None):
        self.config = config or PDPolicyConfig()
        self.prefill = Router(num_prefill, self.config.prefill)
        self.decode = [DecodeView(i) for i in range(num_decode)]
        self._decode_assigned: dict[str, tuple[int, int]] = {}  # request -> (engine, tokens)
        self.block_size_known = False

    # ---- prefill -------------------------------------------------------------------------

    @property
    def num_prefill_up(self) -> int:
        return self.prefill.num_up

    def wants_prompt_ids(self) -> bool:
        """Whether a prompt's token ids would change the prefill choice: more than one prefill
        engine is up and their block size is known."""
        return self.block_size_known and self.prefill.num_up > 1

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        return hash_prompt_blocks(list(token_ids), self.prefill.config.block_size, cache_salt)

    def pick_prefill(
        self,
        request_id: str,
        token_ids: Sequence[int] | None,
        cache_salt: str | None = None,
        session: str | None = None,
        exclude: Collection[int] = (),
    ) -> RouteDecision | None:
        """The prefill engine for a request (None: none is up outside `exclude`), in flight
        there until `finish_prefill`. Without token ids, the choice is by load alone."""
        hashes = self.block_hashes(token_ids, cache_salt) if token_ids else []
        num_tokens = len(token_ids) if token_ids else 0
        self.prefill.finish(request_id, served=False)  # a retry replaces the last assignment
        try:
            return self.prefill.route(
                request_id, hashes, num_tokens, session=session, exclude=exclude
            )
        except EngineDeadError:
            return None

    def finish_prefill(self, request_id: str, served: bool = True) -> None:
        self.prefill.finish(request_id, served)

    def set_block_size(self, block_size: int) -> None:
        self.prefill.config.block_size = block_size
        self.block_size_known = True

    def apply_kv_events(self, engine_id: int, events: Iterable[KVEvent]) -> None:
        self.prefill.apply_kv_events(engine_id, events)

    def set_prefill_up(self, engine_id: int, up: bool) -> None:
        """An engine answering again starts from an empty index (its events will fill it)."""
        if up and not self.prefill.replicas[engine_id].up:
            self.prefill.mark_up(engine_id)
        elif not up and self.prefill.replicas[engine_id].up:
            self.prefill.mark_down(engine_id)

    # ---- decode --------------------------------------------------------------------------

    def pick_decode(
        self, request_id: str, num_tokens: int, exclude: Collection[int] = ()
    ) -> int | None:
        """The decode engine with the fewest requests, then tokens, in flight (None: none is
        up outside `exclude`); in flight there until `finish_decode`."""
        live = [d for d in self.decode if d.up and d.engine_id not in exclude]
        if not live:
            return None
        best = min(live, key=lambda d: (d.in_flight, d.in_flight_tokens, d.served, d.engine_id))
        self.finish_decode(request_id, served=False)  # a retry replaces the last assignment
        best.in_flight += 1
        best.in_flight_tokens += num_tokens
        self._decode_assigned[request_id] = (best.engine_id, num_tokens)
        return best.engine_id

    def finish_decode(self, request_id: str, served: bool = True) -> None:
        assigned = self._decode_assigned.pop(request_id, None)
        if assigned is None:
            return
        view = self.decode[assigned[0]]
        view.in_flight -= 1
        view.in_flight_tokens -= assigned[1]
        view.served += served

    def set_decode_up(self, engine_id: int, up: bool) -> None:
        self.decode[engine_id].up = up

    @property
    def num_decode_up(self) -> int:
        return sum(d.up for d in self.decode)


def parse_kv_events(raw: Iterable[Sequence]) -> list[KVEvent]:
    """Events as `GET /kv_events` sends them, `[[kind, "hex hash"], ...]`, as the router's."""
    return [(int(kind), bytes.fromhex(h)) for kind, h in raw]
