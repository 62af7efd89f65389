"""Cache-aware routing over several engines: pick the engine that holds the longest prefix of a
request's rendered tokens.

The reason to render outside the engine is that a router sees the token ids and media hashes
before it picks an engine. Every tito engine publishes what its prefix cache stores, evicts and
clears (`EngineService.SubscribeKvEvents`, vLLM's event shapes); `EngineRouter` keeps one
subscription per engine and builds a `PrefixIndex`: for each engine, the chain keys of the blocks
it holds. A block's chain key covers its token ids, its extra keys (every media item's `mm_hash`
and offset in the block, the `cache_salt` on the first block) and its parent's chain key, so it
is the same for the same content on every engine and never depends on an engine's opaque block
ids. A request's chain keys are computed the same way from its `GenerateRequest`; the engine
with the most leading blocks wins, ties and cold prompts go to the least loaded (`GetLoad`, or
what this router has in flight there and on its way there when that is more: a request counts from
the moment it is sent, `reserve`, so a burst spreads before GetLoad sees any of it).

LoRA adapters: a chain starts from the adapter's name (`BlockStored.lora_name`,
`GenerateRequest.lora_name`), so blocks computed under one adapter never count for another or for
the base model. A request naming an adapter goes to an engine that holds it (GetLoad lists their
adapters) and has room (fewer requests than its GetModelInfo max_running_requests), by prefix and
load among them; else, when the router knows where the adapter lies (`lora_paths`: name -> its
directory under the engines' --lora-dir), to the least loaded engine, which loads it first
(adapter_loads.py: concurrent first requests share one load); else to the holders, or when none,
to the least loaded engine (which refuses it NOT_FOUND unless it was loaded meanwhile). The
request's stream waits for the load (`adapter_ready`) before it opens its call.

Engines come and go: from a static list, or from DNS (`dns:///engines.default.svc:50052`, a
headless Service: every address it resolves to is an engine, re-resolved periodically). An
engine whose event stream stops (or fails) is routed to by load only until its stream recovers
(its view is rebuilt by replaying from where it left off, or from the oldest buffered batch when
that was dropped). An engine that does not answer `GetLoad` is left out until it does; one that
reports `draining` (EngineService.Drain, SIGTERM) or refuses a request as draining is left out at
once. A chat whose engine goes away mid-stream moves to another engine, up to `migration_limit`
times (migration.py, engine_stream.py).

Policies: `cache_aware` (the default), `least_load`, `round_robin`.

Prefill/decode roles (`prefill_engines`, `decode_engines`; `engines` are mixed and serve both):
with prefill engines, a prompt whose part not cached on its decode engine is at least
`pd_min_prompt_tokens` tokens is prefilled on a prefill (or mixed) engine and decoded on a decode
(or mixed) one, each picked by the policy among its role (disaggregation.py); shorter prompts,
and every request when there are no prefill engines, go to one decode or mixed engine. A prefill
engine is only picked for a decode engine that speaks the same KV transfer protocol
(GetModelInfo's kv_transfer_protocol and kv_connector: tito's own, or one vLLM connector;
kv_protocols.py).

Threads, not asyncio: the subscriptions and load polls run on daemon threads with synchronous
stubs, and `pick` is a short call under a lock, so the same router serves `ChatPipeline` and
`AsyncChatPipeline` (and a gateway's event loop) alike.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc

from tito.grpc_errors import error_details
from tito.security import ClientSecurity
from tito.v1 import engine_pb2, engine_pb2_grpc
from tito_client.adapter_loads import AdapterLoad, loaded
from tito_client.kv_protocols import TITO, protocol_name
from tito_client.migration import engine_draining

log = logging.getLogger(__name__)

POLICIES = ("cache_aware", "least_load", "round_robin")
#: How long a request sent to an engine counts in its load before its stream starts (`track`):
#: one whose stream never starts (its caller gave up in between) stops counting then.
RESERVATION_SECONDS = 5.0
_ROOT = b"tito-route\0"


# ------------------------------------------------------------------------------ chain keys

def _chain(parent: bytes, tokens: Sequence[int], media: Iterable[tuple[str, int]], salt: str) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(struct.pack(f"<{len(tokens)}I", *tokens))
    for mm_hash, offset in media:
        encoded = mm_hash.encode()
        digest.update(b"\0mm" + struct.pack("<qI", offset, len(encoded)) + encoded)
    if salt:
        encoded = salt.encode()
        digest.update(b"\0salt" + struct.pack("<I", len(encoded)) + encoded)
    return digest.digest()


def chain_root(lora_name: str) -> bytes:
    """Where a prompt's chain starts: the base model's root, or one per LoRA adapter."""
    if not lora_name:
        return _ROOT
    return hashlib.blake2b(_ROOT + b"lora\0" + lora_name.encode(), digest_size=16).digest()


def request_keys(request: engine_pb2.GenerateRequest, block_size: int) -> list[bytes]:
    """Chain keys of the request's full prompt blocks, as engines' events describe them."""
    tokens = request.token_ids
    items = [(item.mm_hash, item.placeholder.offset, item.placeholder.length) for item in request.mm_features.items]
    keys, parent = [], chain_root(request.lora_name)
    for index in range(len(tokens) // block_size):
        start, end = index * block_size, (index + 1) * block_size
        media = [(mm_hash, offset - start) for mm_hash, offset, length in items
                 if offset < end and offset + length > start]
        parent = _chain(parent, tokens[start:end], media, request.cache_salt if index == 0 else "")
        keys.append(parent)
    return keys


# ------------------------------------------------------------------------------ the index

class EngineView:
    """What one engine's prefix cache holds, as its events said: chain key per block id."""

    def __init__(self) -> None:
        self.key_of: dict[bytes, bytes] = {}  # the engine's block id -> chain key
        self.held: dict[bytes, int] = {}  # chain key -> blocks holding it
        self.block_size = 0
        self.next_sequence: int | None = None  # the next batch expected (None: not subscribed yet)

    def clear(self) -> None:
        self.key_of.clear()
        self.held.clear()

    def apply(self, batch: engine_pb2.SubscribeKvEventsResponse) -> None:
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "block_stored":
                self._stored(event.block_stored)
            elif kind == "block_removed":
                for block_id in event.block_removed.block_hashes:
                    key = self.key_of.pop(block_id, None)
                    if key is not None:
                        count = self.held[key] - 1
                        if count:
                            self.held[key] = count
                        else:
                            del self.held[key]
            elif kind == "all_blocks_cleared":
                self.clear()
        self.next_sequence = batch.sequence + 1

    def _stored(self, stored: engine_pb2.BlockStored) -> None:
        size = stored.block_size
        self.block_size = size
        if stored.HasField("parent_block_hash"):
            parent = self.key_of.get(stored.parent_block_hash)
            if parent is None:  # its parent was never seen (evicted, or before our view): unreachable
                return
        else:
            parent = chain_root(stored.lora_name)
        for index, block_id in enumerate(stored.block_hashes):
            keys = stored.extra_keys[index] if index < len(stored.extra_keys) else None
            media = [(key.mm_hash, key.offset) for key in keys.media] if keys is not None else []
            salt = keys.cache_salt if keys is not None else ""
            parent = _chain(parent, stored.token_ids[index * size:(index + 1) * size], media, salt)
            if block_id not in self.key_of:
                self.key_of[block_id] = parent
                self.held[parent] = self.held.get(parent, 0) + 1

    def matched_blocks(self, keys: Sequence[bytes]) -> int:
        count = 0
        for key in keys:
            if key not in self.held:
                break
            count += 1
        return count


# ------------------------------------------------------------------------------ engines

@dataclass
class Engine:
    """One engine endpoint as the router tracks it."""

    address: str
    view: EngineView = field(default_factory=EngineView)
    events_live: bool = False  # its event stream is connected and in sync
    reachable: bool = True  # it answered its last GetLoad
    draining: bool = False  # it is draining (GetLoad said so, or it refused a request as draining)
    reported_load: int = 0  # running + waiting requests at its last GetLoad
    in_flight: int = 0  # requests this router has running there
    reserved: list[float] = field(default_factory=list)  # when requests were sent there, not streaming yet
    block_size: int = 0  # GetLoad's kv_block_size
    adapters: frozenset[str] = frozenset()  # the LoRA adapters it held at its last GetLoad
    capacity: int | None = None  # GetModelInfo's max_running_requests (0: it does not say; None: not asked yet)
    kv_protocol: int = TITO  # GetModelInfo's kv_transfer_protocol (unspecified: tito's, as before the field)
    kv_connector: str = ""  # GetModelInfo's kv_connector (vLLM's connector protocol)
    loading: dict[str, AdapterLoad] = field(default_factory=dict)  # this router's loads running there
    loaded_at: dict[str, float] = field(default_factory=dict)  # adapter -> when this router's load of it ended
    stopped: bool = False
    channel: grpc.Channel | None = None
    stream: object = None  # the SubscribeKvEvents call, to cancel it

    @property
    def load(self) -> int:
        now = time.monotonic()
        on_the_way = sum(1 for sent in self.reserved if now - sent < RESERVATION_SECONDS)
        return max(self.reported_load, self.in_flight + on_the_way)

    def holds(self, adapter: str) -> bool:
        """It holds `adapter`, or this router is loading it there."""
        return adapter in self.adapters or adapter in self.loading

    @property
    def has_room(self) -> bool:
        """Another request would run at once rather than wait for a batch slot."""
        return not self.capacity or self.load < self.capacity


@dataclass(frozen=True)
class Choice:
    """Where a request goes and why."""

    address: str
    matched_blocks: int  # cached prefix blocks the index says the engine holds
    policy: str
    block_size: int = 0  # the engine's tokens per block (0: not known yet)
    adapter_load: AdapterLoad | None = None  # the load of the request's adapter there, when one runs
    kv_protocol: int = TITO  # how the engine moves KV in a prefill/decode split (kv_protocols.py)
    kv_connector: str = ""  # which vLLM connector, with vLLM's connector protocol

    @property
    def matched_tokens(self) -> int:
        return self.matched_blocks * self.block_size

    def pairs_with(self, engine: "Engine") -> bool:
        """`engine` speaks this engine's KV transfer protocol (one can prefill for the other)."""
        return (engine.kv_protocol, engine.kv_connector) == (self.kv_protocol, self.kv_connector)


def _choice(engine: Engine, matched: int, policy: str, adapter_load: AdapterLoad | None = None) -> Choice:
    return Choice(engine.address, matched, policy, engine.view.block_size or engine.block_size,
                  adapter_load=adapter_load, kv_protocol=engine.kv_protocol, kv_connector=engine.kv_connector)


class NoEngineAvailable(RuntimeError):
    """No engine is known and reachable right now."""


class EngineRouter:
    """Picks an engine per request (see the module docstring). `engines`: addresses (host:port) or
    one `dns:///NAME:PORT`; call `start()` first and `close()` at the end."""

    def __init__(self, engines: Sequence[str] | str, *, policy: str = "cache_aware",
                 security: ClientSecurity = ClientSecurity(), load_interval: float = 0.25,
                 resolve_interval: float = 5.0, retry_interval: float = 0.5,
                 resolver: Callable[[str, int], list[str]] | None = None, migration_limit: int = 3,
                 lora_paths: Mapping[str, str] | None = None, lora_load_timeout: float = 120.0,
                 prefill_engines: Sequence[str] = (), decode_engines: Sequence[str] = (),
                 pd_min_prompt_tokens: int = 256):
        """`migration_limit`: how many times one request may move to another engine after its
        engine went away mid-stream (0: never; migration.py). `lora_paths`: the LoRA adapters this
        router may load on an engine when none holds one with room, name -> directory under the
        engines' --lora-dir (each LoadLoraAdapter bounded by `lora_load_timeout` seconds).
        `prefill_engines`, `decode_engines`: addresses that serve only that role (`engines`: both);
        prompts shorter than `pd_min_prompt_tokens` skip the prefill engines."""
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} must be one of {', '.join(POLICIES)}")
        if migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {migration_limit}")
        self.policy = policy
        self.migration_limit = migration_limit
        self._spec = ([engines] if isinstance(engines, str) else list(engines)) + list(prefill_engines) \
            + list(decode_engines)
        self._only = {**{address: "prefill" for address in prefill_engines},
                      **{address: "decode" for address in decode_engines}}
        if pd_min_prompt_tokens < 1:
            raise ValueError(f"pd_min_prompt_tokens must be >= 1, got {pd_min_prompt_tokens}")
        self.pd_min_prompt_tokens = pd_min_prompt_tokens
        if not self._spec:
            raise ValueError("give at least one engine address (host:port) or dns:///NAME:PORT")
        self._security = security
        self._load_interval = load_interval
        self._resolve_interval = resolve_interval
        self._retry_interval = retry_interval
        self._resolver = resolver or _resolve
        self.lora_paths = dict(lora_paths or {})
        self._lora_load_timeout = lora_load_timeout
        self._lock = threading.Lock()
        self._engines: dict[str, Engine] = {}
        self._round_robin = itertools.count()
        self._seen: set[str] = set()  # first_time's keys
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> "EngineRouter":
        self._refresh_engines()
        self._spawn(self._maintain, "tito-router-maintain")
        return self

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            engines = list(self._engines.values())
            self._engines.clear()
        for engine in engines:
            self._stop_engine(engine)
        for thread in self._threads:
            thread.join(2.0)

    def __enter__(self) -> "EngineRouter":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _spawn(self, target, name: str, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # ---------------------------------------------------------------- picking

    def addresses(self) -> list[str]:
        with self._lock:
            return list(self._engines)

    def disaggregates(self, request: engine_pb2.GenerateRequest, decode: Choice | None = None) -> bool:
        """Whether `request` is prefilled on a prefill engine before it decodes on `decode`: when
        there are prefill engines and the part of its prompt `decode` does not hold in its prefix
        cache is at least `pd_min_prompt_tokens` long (a follow-up turn whose history is cached
        where it decodes prefills there)."""
        cached = decode.matched_tokens if decode is not None else 0
        return "prefill" in self._only.values() and len(request.token_ids) - cached >= self.pd_min_prompt_tokens

    def pick(self, request: engine_pb2.GenerateRequest, avoid: str | None = None, role: str = "decode",
             pair_with: Choice | None = None) -> Choice:
        """The engine for `request` under the router's policy among those serving `role`
        ("prefill" or "decode": every request ends on a decode or mixed engine); `avoid` (the
        engine a chat just left) only when no other engine is available; `pair_with` (the decode
        engine of a split): only engines that speak its KV transfer protocol."""
        with self._lock:
            candidates = [engine for engine in self._engines.values()
                          if engine.reachable and not engine.draining and not engine.stopped
                          and self._only.get(engine.address, role) == role]
            if avoid is not None and len(candidates) > 1:
                candidates = [engine for engine in candidates if engine.address != avoid] or candidates
            if not candidates:
                raise NoEngineAvailable(f"no engine is reachable (known: {', '.join(self._engines) or 'none'})")
            if pair_with is not None:
                candidates = self._paired(candidates, pair_with)
            if request.lora_name:
                candidates, loader = self._adapter_candidates(candidates, request.lora_name)
                if loader is not None:
                    load = self._start_load(loader, request.lora_name)
                    return _choice(loader, self._matched(loader, request, {}), self.policy, adapter_load=load)
            if self.policy == "round_robin":
                engine = candidates[next(self._round_robin) % len(candidates)]
                return _choice(engine, self._matched(engine, request, {}), self.policy)
            if self.policy == "least_load":
                engine = min(candidates, key=lambda e: (e.load, e.address))
                return _choice(engine, self._matched(engine, request, {}), self.policy)
            keys_by_size: dict[int, list[bytes]] = {}
            scored = [(self._matched(engine, request, keys_by_size) if engine.events_live else 0, engine)
                      for engine in candidates]
            best = max(matched for matched, _ in scored)
            matched, engine = min(((m, e) for m, e in scored if m == best), key=lambda pair: (pair[1].load,
                                                                                              pair[1].address))
            return _choice(engine, matched, self.policy)

    @staticmethod
    def _paired(candidates: list[Engine], decode: Choice) -> list[Engine]:
        paired = [engine for engine in candidates if decode.pairs_with(engine)]
        if not paired:
            spoken = ", ".join(f"{e.address}: {protocol_name(e.kv_protocol, e.kv_connector)}" for e in candidates)
            raise NoEngineAvailable(f"none speaks {protocol_name(decode.kv_protocol, decode.kv_connector)} "
                                    f"(they speak {spoken})")
        return paired

    def first_time(self, key: str) -> bool:
        """True the first time this router is asked about `key`: a fleet set up in a way that
        costs every request alike is logged once, not per request."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True

    def _adapter_candidates(self, candidates: list[Engine], adapter: str) -> tuple[list[Engine], Engine | None]:
        """Where a request for `adapter` may go: (the engines to choose among, None), or ([], the
        engine that must load it first)."""
        holders = [engine for engine in candidates if engine.holds(adapter)]
        with_room = [engine for engine in holders if engine.has_room]
        if with_room:
            return with_room, None
        if adapter in self.lora_paths:
            engine = min(candidates, key=lambda e: (e.load, e.address))
            return ([engine], None) if engine.holds(adapter) else ([], engine)
        return holders or candidates, None

    def _start_load(self, engine: Engine, adapter: str) -> AdapterLoad:
        """Load `adapter` on `engine` on a thread of its own (under the lock: one load per pair)."""
        load = engine.loading[adapter] = AdapterLoad(engine.address, adapter, self.lora_paths[adapter])
        log.info("loading LoRA adapter %s on %s (no engine holds it with room)", adapter, engine.address)
        # Not one of self._threads: it ends with its call (bounded by lora_load_timeout).
        threading.Thread(target=self._load_adapter, args=(engine, load), name=f"tito-router-lora-{engine.address}",
                         daemon=True).start()
        return load

    def _load_adapter(self, engine: Engine, load: AdapterLoad) -> None:
        error: grpc.RpcError | None = None
        gone = False
        try:
            engine_pb2_grpc.EngineServiceStub(engine.channel).LoadLoraAdapter(
                engine_pb2.LoadLoraAdapterRequest(lora_name=load.name, lora_path=load.path),
                timeout=self._lora_load_timeout, metadata=self._security.call_metadata() or None)
        except grpc.RpcError as exc:
            error = None if loaded(exc) else exc
        except ValueError:  # its channel was closed meanwhile: the engine left (the request's call
            gone = True  # there fails UNAVAILABLE and moves on, migration.py)
        with self._lock:
            engine.loading.pop(load.name, None)
            if error is None and not gone:
                engine.adapters |= {load.name}
                engine.loaded_at[load.name] = time.monotonic()
        if error is not None:
            log.warning("loading LoRA adapter %s on %s failed: %s", load.name, engine.address, error)
        load.finish(error)

    def adapter_ready(self, address: str, adapter: str) -> None:
        """Wait until a load of `adapter` this router runs on `address` (if any) ended; raise its
        refusal. What a request's stream calls before it opens its Generate call there."""
        pending = self._pending_load(address, adapter)
        if pending is not None:
            pending.wait(self._lora_load_timeout)

    async def adapter_ready_async(self, address: str, adapter: str) -> None:
        """`adapter_ready` for an event loop (returns at once when no load runs)."""
        pending = self._pending_load(address, adapter)
        if pending is not None:
            await pending.wait_async(self._lora_load_timeout)

    def _pending_load(self, address: str, adapter: str) -> AdapterLoad | None:
        if not adapter:
            return None
        with self._lock:
            engine = self._engines.get(address)
            return engine.loading.get(adapter) if engine is not None else None

    def _matched(self, engine: Engine, request, keys_by_size: dict[int, list[bytes]]) -> int:
        size = engine.view.block_size or engine.block_size
        if not size:
            return 0
        keys = keys_by_size.get(size)
        if keys is None:
            keys = keys_by_size[size] = request_keys(request, size)
        return engine.view.matched_blocks(keys)

    def reserve(self, address: str) -> None:
        """A request is on its way to `address`: count it in the engine's load now, until its
        stream starts (`track`), so that a burst of picks spreads over the engines rather than
        all going to the one that was least loaded before any of them started."""
        with self._lock:
            engine = self._engines.get(address)
            if engine is not None:
                now = time.monotonic()
                engine.reserved = [sent for sent in engine.reserved if now - sent < RESERVATION_SECONDS]
                engine.reserved.append(now)

    @contextmanager
    def track(self, address: str):
        """Count a request in flight on `address` while the block runs (it takes the place of its
        reservation); a connection failure (UNAVAILABLE) marks the engine unreachable (or
        draining) at once, so new requests go elsewhere."""
        with self._lock:
            engine = self._engines.get(address)
            if engine is not None:
                engine.in_flight += 1
                if engine.reserved:
                    engine.reserved.pop(0)
        try:
            yield
        except grpc.RpcError as exc:
            if engine_draining(exc):
                self.mark_draining(address)
            elif exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.mark_unreachable(address)
            raise
        finally:
            with self._lock:
                if engine is not None:
                    engine.in_flight -= 1

    def mark_unreachable(self, address: str) -> None:
        with self._lock:
            engine = self._engines.get(address)
            if engine is not None:
                engine.reachable = False

    def poll_loads(self) -> None:
        """Ask every engine's GetLoad now rather than at the next poll (e.g. after loading an
        adapter everywhere, so the next pick knows it)."""
        with self._lock:
            engines = list(self._engines.values())
        for engine in engines:
            self._poll_load(engine)

    def adapters(self) -> list[str]:
        """The LoRA adapters any reachable engine held at its last GetLoad, sorted."""
        with self._lock:
            return sorted(set().union(*(e.adapters for e in self._engines.values() if e.reachable)))

    def mark_draining(self, address: str) -> None:
        with self._lock:
            engine = self._engines.get(address)
            if engine is not None:
                engine.draining = True

    def status(self) -> dict[str, dict]:
        """Per engine: reachable, draining, events_live, load, cached blocks known (for operators and tests)."""
        with self._lock:
            return {address: {"reachable": e.reachable, "draining": e.draining, "events_live": e.events_live,
                              "load": e.load,
                              "in_flight": e.in_flight, "cached_blocks": len(e.view.key_of)}
                    for address, e in self._engines.items()}

    # ---------------------------------------------------------------- engines coming and going

    def _wanted(self) -> set[str]:
        wanted: set[str] = set()
        for entry in self._spec:
            if entry.startswith("dns:///"):
                host, _, port = entry.removeprefix("dns:///").rpartition(":")
                try:
                    wanted.update(self._resolver(host, int(port)))
                except OSError as exc:
                    log.warning("resolving %s failed: %s", entry, exc)
                    with self._lock:  # keep what we had rather than dropping every engine
                        wanted.update(a for a in self._engines)
            else:
                wanted.add(entry)
        return wanted

    def _refresh_engines(self) -> None:
        wanted = self._wanted()
        with self._lock:
            gone = [self._engines.pop(address) for address in list(self._engines) if address not in wanted]
            new = [Engine(address) for address in sorted(wanted) if address not in self._engines]
            for engine in new:
                self._engines[engine.address] = engine
        for engine in gone:
            log.info("engine %s left", engine.address)
            self._stop_engine(engine)
        for engine in new:
            log.info("engine %s joined", engine.address)
            engine.channel = self._security.channel(engine.address)
            self._poll_load(engine)
            self._spawn(self._follow_events, f"tito-router-events-{engine.address}", engine)

    def _stop_engine(self, engine: Engine) -> None:
        engine.stopped = True
        stream = engine.stream
        if stream is not None:
            stream.cancel()
        if engine.channel is not None:
            engine.channel.close()

    def _maintain(self) -> None:
        next_resolve = time.monotonic() + self._resolve_interval
        while not self._closed.wait(self._load_interval):
            with self._lock:
                engines = list(self._engines.values())
            for engine in engines:
                self._poll_load(engine)
            if time.monotonic() >= next_resolve and any(entry.startswith("dns:///") for entry in self._spec):
                self._refresh_engines()
                next_resolve = time.monotonic() + self._resolve_interval

    def _poll_load(self, engine: Engine) -> None:
        if engine.stopped or engine.channel is None:
            return
        asked = time.monotonic()
        try:
            load = engine_pb2_grpc.EngineServiceStub(engine.channel).GetLoad(
                engine_pb2.GetLoadRequest(), timeout=max(1.0, 4 * self._load_interval),
                metadata=self._security.call_metadata() or None)
        except grpc.RpcError:
            with self._lock:
                engine.reachable = False
            return
        except ValueError:  # the channel was closed meanwhile (the engine left)
            return
        with self._lock:
            engine.reachable = True
            engine.draining = load.draining
            engine.reported_load = load.running_requests + load.waiting_requests
            engine.block_size = load.kv_block_size
            # An adapter this router loaded after the engine answered is held though not listed.
            engine.loaded_at = {name: at for name, at in engine.loaded_at.items() if at > asked}
            engine.adapters = frozenset(adapter.name for adapter in load.lora_adapters) | set(engine.loaded_at)
        if engine.capacity is None:  # once it answers (a down engine is not asked twice per poll)
            self._ask_model_info(engine)

    def _ask_model_info(self, engine: Engine) -> None:
        """GetModelInfo, once: its max_running_requests (what `has_room` compares the load with)
        and how it moves KV in a prefill/decode split (which engines it pairs with)."""
        try:
            info = engine_pb2_grpc.EngineServiceStub(engine.channel).GetModelInfo(
                engine_pb2.EngineServiceGetModelInfoRequest(), timeout=max(1.0, 4 * self._load_interval),
                metadata=self._security.call_metadata() or None)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # it cannot say: never full, for the router
                engine.capacity = 0
            return  # else: asked again at the next poll
        except ValueError:  # the channel was closed meanwhile (the engine left)
            return
        with self._lock:
            engine.kv_protocol = info.kv_transfer_protocol or TITO
            engine.kv_connector = info.kv_connector
            engine.capacity = info.max_running_requests

    def _follow_events(self, engine: Engine) -> None:
        """Keep `engine`'s view in sync with its events; on any break, route it by load only
        (events_live False) and reconnect, resuming where it left off."""
        stub = engine_pb2_grpc.EngineServiceStub(engine.channel)
        metadata = self._security.call_metadata() or None
        while not engine.stopped and not self._closed.is_set():
            request = engine_pb2.SubscribeKvEventsRequest(start_sequence=engine.view.next_sequence or 0)
            try:
                stream = stub.SubscribeKvEvents(request, metadata=metadata)
                engine.stream = stream
                for batch in stream:
                    with self._lock:
                        if batch.sequence != engine.view.next_sequence and engine.view.next_sequence is not None:
                            engine.view.clear()  # a gap: the view cannot be trusted any more
                        engine.view.apply(batch)
                        engine.events_live = True
            except grpc.RpcError as exc:
                with self._lock:
                    engine.events_live = False
                    if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                        # Dropped or from a former life of the engine: start over from what it still has.
                        engine.view.clear()
                        engine.view.next_sequence = _oldest_sequence(exc)
                if engine.stopped or self._closed.is_set():
                    return
                if exc.code() != grpc.StatusCode.OUT_OF_RANGE:
                    log.info("KV events of %s stopped (%s); routing it by load until they resume", engine.address,
                             exc.code().name)
            except ValueError:  # its channel was closed: the engine left
                return
            with self._lock:
                engine.events_live = False
            self._closed.wait(self._retry_interval)


def _oldest_sequence(error: grpc.RpcError) -> int:
    try:
        return int(error_details(error)["metadata"].get("oldest_sequence", 0))
    except (KeyError, ValueError):
        return 0


def _resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, as host:port (IPv6 in brackets)."""
    addresses = set()
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        ip = sockaddr[0]
        addresses.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return sorted(addresses)
