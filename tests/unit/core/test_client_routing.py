"""tito_client.routing without models: the prefix index fed by scripted KV events (media- and
salt-aware chain keys), the three policies, an engine whose events stop (routed by load only until
they resume, resuming where they left off), a dropped sequence (view rebuilt), and engines that come
and go by DNS. The engines are scripted EngineService servers on port 0."""

from __future__ import annotations

import queue
import threading
import time
from concurrent import futures

import grpc
import pytest

from tito.v1 import engine_pb2, engine_pb2_grpc, multimodal_pb2
from tito_client import routing
from tito_client.routing import EngineRouter, EngineView, NoEngineAvailable, request_keys

BLOCK = 4


def generate_request(tokens, salt="", media=(), lora_name=""):
    message = engine_pb2.GenerateRequest(token_ids=tokens, cache_salt=salt, lora_name=lora_name)
    for mm_hash, offset, length in media:
        message.mm_features.items.add(mm_hash=mm_hash, placeholder=multimodal_pb2.PlaceholderRange(
            offset=offset, length=length))
    return message


def stored_batch(sequence, tokens, ids, salt="", media=(), parent=None, lora_name=""):
    """A BlockStored batch for full blocks of `tokens`, keyed as an engine keys them."""
    batch = engine_pb2.SubscribeKvEventsResponse(sequence=sequence, timestamp=time.time())
    stored = batch.events.add().block_stored
    stored.lora_name = lora_name
    stored.block_hashes.extend(ids)
    stored.token_ids.extend(tokens)
    stored.block_size = BLOCK
    if parent is not None:
        stored.parent_block_hash = parent
    start_block = 0 if parent is None else None
    for index in range(len(ids)):
        keys = stored.extra_keys.add()
        if index == 0 and start_block == 0 and salt:
            keys.cache_salt = salt
        start = index * BLOCK
        for mm_hash, offset, length in media:
            if offset < start + BLOCK and offset + length > start:
                keys.media.add(mm_hash=mm_hash, offset=offset - start)
    return batch


def removed_batch(sequence, ids):
    batch = engine_pb2.SubscribeKvEventsResponse(sequence=sequence)
    batch.events.add().block_removed.block_hashes.extend(ids)
    return batch


# ------------------------------------------------------------------------------ the index alone

def test_chain_keys_match_the_engines_blocks_by_tokens_salt_and_media():
    tokens = list(range(10, 22))  # 3 blocks
    image = ("a" * 16, 5, 4)  # covers blocks 1 and 2
    view = EngineView()
    view.apply(stored_batch(0, tokens, [b"x0", b"x1", b"x2"], salt="s", media=[image]))
    assert view.matched_blocks(request_keys(generate_request(tokens, "s", [image]), BLOCK)) == 3
    assert view.matched_blocks(request_keys(generate_request(tokens + [1, 2], "s", [image]), BLOCK)) == 3
    assert view.matched_blocks(request_keys(generate_request(tokens, "other", [image]), BLOCK)) == 0  # salt
    assert view.matched_blocks(request_keys(generate_request(tokens, "s", [("b" * 16, 5, 4)]), BLOCK)) == 1  # pixels
    assert view.matched_blocks(request_keys(generate_request(tokens, "s", [("a" * 16, 6, 3)]), BLOCK)) == 1  # place
    # A continuation keyed by its parent's id extends the chain; a removal cuts it.
    view.apply(stored_batch(1, list(range(22, 26)), [b"x3"], parent=b"x2"))
    longer = generate_request(list(range(10, 26)) + [7], "s", [image])
    assert view.matched_blocks(request_keys(longer, BLOCK)) == 4
    view.apply(removed_batch(2, [b"x1"]))
    assert view.matched_blocks(request_keys(longer, BLOCK)) == 1
    cleared = engine_pb2.SubscribeKvEventsResponse(sequence=3)
    cleared.events.add().all_blocks_cleared.SetInParent()
    view.apply(cleared)
    assert view.matched_blocks(request_keys(longer, BLOCK)) == 0 and view.next_sequence == 4


# ------------------------------------------------------------------------------ scripted engines

class ScriptedEngine(engine_pb2_grpc.EngineServiceServicer):
    """GetLoad answers `load`; SubscribeKvEvents replays `batches` from the start asked for, then
    streams what `push` adds, until `fail` ends every stream with UNAVAILABLE."""

    def __init__(self):
        self.load = 0
        self.batches: list = []
        self.starts: list[int | None] = []
        self.feeds: list[queue.Queue] = []
        self.lock = threading.Lock()
        self.oldest = 0
        self.down = False  # GetLoad fails
        self.draining = False  # GetLoad says it drains
        self.adapters: list[str] = []  # LoRA adapters GetLoad reports
        self.capacity = 0  # GetModelInfo's max_running_requests (0: it does not say)
        self.loads: list[tuple[str, str]] = []  # LoadLoraAdapter calls: (name, path)
        self.load_seconds = 0.0  # how long a LoadLoraAdapter takes
        self.refuse_loads = False  # LoadLoraAdapter answers INVALID_ARGUMENT
        self.kv_protocol = engine_pb2.KV_TRANSFER_PROTOCOL_UNSPECIFIED  # GetModelInfo's kv_transfer_protocol
        self.kv_connector = ""

    def push(self, batch):
        with self.lock:
            self.batches.append(batch)
            for feed in self.feeds:
                feed.put(batch)

    def fail(self):
        with self.lock:
            for feed in self.feeds:
                feed.put(None)
            self.feeds = []

    def GetLoad(self, request, context):
        if self.down:
            context.abort(grpc.StatusCode.UNAVAILABLE, "down")
        return engine_pb2.GetLoadResponse(running_requests=self.load, kv_block_size=BLOCK, draining=self.draining,
                                          lora_adapters=[engine_pb2.LoraAdapterInfo(name=name)
                                                         for name in self.adapters])

    def GetModelInfo(self, request, context):
        return engine_pb2.EngineServiceGetModelInfoResponse(max_running_requests=self.capacity,
                                                            kv_transfer_protocol=self.kv_protocol,
                                                            kv_connector=self.kv_connector)

    def LoadLoraAdapter(self, request, context):
        with self.lock:
            self.loads.append((request.lora_name, request.lora_path))
        time.sleep(self.load_seconds)
        if self.refuse_loads:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"lora_path: {request.lora_path} is not under --lora-dir")
        self.adapters.append(request.lora_name)
        return engine_pb2.LoadLoraAdapterResponse(adapter=engine_pb2.LoraAdapterInfo(name=request.lora_name))

    def SubscribeKvEvents(self, request, context):
        start = request.start_sequence if request.HasField("start_sequence") else None
        self.starts.append(start)
        if start is not None and start < self.oldest:
            from grpc_status import rpc_status
            from google.rpc import code_pb2, error_details_pb2, status_pb2

            info = error_details_pb2.ErrorInfo(reason="KV_EVENTS_SEQUENCE_DROPPED", domain="tito.dev",
                                               metadata={"oldest_sequence": str(self.oldest)})
            status = status_pb2.Status(code=code_pb2.OUT_OF_RANGE, message="dropped")
            status.details.add().Pack(info)
            context.abort_with_status(rpc_status.to_status(status))
        feed: queue.Queue = queue.Queue()
        with self.lock:
            backlog = [batch for batch in self.batches if start is not None and batch.sequence >= start]
            self.feeds.append(feed)
        yield from backlog
        while context.is_active():
            try:
                batch = feed.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, "events stopped")
            yield batch


@pytest.fixture
def engines():
    servers, started = [], []

    def start(count):
        for _ in range(count):
            engine = ScriptedEngine()
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
            engine_pb2_grpc.add_EngineServiceServicer_to_server(engine, server)
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            servers.append(server)
            started.append((f"127.0.0.1:{port}", engine))
        return started[-count:]

    yield start
    for server in servers:
        server.stop(0)


def wait_for(predicate, what):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


def test_cache_aware_picks_the_longest_prefix_then_the_least_load(engines):
    (a, engine_a), (b, engine_b), (c, engine_c) = engines(3)
    engine_a.load, engine_b.load, engine_c.load = 3, 1, 2
    system = list(range(100, 112))  # 3 blocks
    engine_a.push(stored_batch(0, system, [b"a0", b"a1", b"a2"]))
    engine_c.push(stored_batch(0, system[:4], [b"c0"]))
    with EngineRouter([a, b, c], load_interval=0.02) as router:
        chat = generate_request(system + [1, 2, 3])
        wait_for(lambda: router.pick(chat).matched_blocks == 3, "engine a's events indexed")
        wait_for(lambda: router.status()[c]["cached_blocks"] == 1, "engine c's events indexed")
        assert router.pick(chat).address == a  # longest prefix, though the busiest
        assert router.pick(generate_request(system[:4] + [9] * 8)).address == c  # 1 block each: c is less loaded
        assert router.pick(generate_request([7] * 12)).address == b  # cold: least loaded
        assert router.pick(generate_request(system + [1], salt="tenant")).address == b  # another salt: cold
        with router.track(b), router.track(b), router.track(b):  # what this router has in flight counts too
            assert router.pick(generate_request([7] * 12)).address == c

        # Policies: least_load ignores the cache, round_robin cycles.
        router.policy = "least_load"
        assert router.pick(chat).address == b
        router.policy = "round_robin"
        assert {router.pick(chat).address for _ in range(3)} == {a, b, c}


def test_a_draining_engine_gets_no_new_request_and_a_moved_chat_avoids_the_engine_it_left(engines):
    (a, engine_a), (b, engine_b) = engines(2)
    engine_a.load, engine_b.load = 0, 4
    chat = generate_request([7] * 12)
    with EngineRouter([a, b], policy="least_load", load_interval=0.02) as router:
        wait_for(lambda: router.status()[b]["load"] == 4, "the loads polled")
        assert router.pick(chat).address == a
        assert router.pick(chat, avoid=a).address == b  # a chat that left a goes elsewhere...
        engine_a.draining = True
        wait_for(lambda: router.status()[a]["draining"], "a's drain seen")
        assert router.pick(chat).address == b  # ...and nothing new goes to a draining engine
        assert router.pick(chat, avoid=b).address == b  # avoided, but the only one left
        engine_a.draining = False  # a restarted engine at the same address serves again
        wait_for(lambda: router.pick(chat).address == a, "a back")
    with pytest.raises(ValueError):
        EngineRouter([a], migration_limit=-1)


def test_prefill_and_decode_roles_split_long_prompts_and_keep_short_ones_off_prefill_engines(engines):
    (p, engine_p), (d, engine_d), (m, engine_m) = engines(3)
    engine_p.load, engine_d.load, engine_m.load = 0, 5, 3
    with EngineRouter([m], prefill_engines=[p], decode_engines=[d], pd_min_prompt_tokens=16, policy="least_load",
                      load_interval=0.02) as router:
        wait_for(lambda: router.status()[d]["load"] == 5, "the loads polled")
        short, long = generate_request([7] * 15), generate_request([7] * 16)
        assert not router.disaggregates(short) and router.disaggregates(long)
        assert router.pick(short).address == m  # the idle prefill engine never decodes
        assert router.pick(long, role="prefill").address == p  # prefill: p (idle) over the mixed m
        engine_m.load = 9
        wait_for(lambda: router.status()[m]["load"] == 9, "m's load")
        assert router.pick(long).address == d and router.pick(long, role="prefill").address == p
    with EngineRouter([m], load_interval=0.02) as router:
        assert not router.disaggregates(generate_request([7] * 4096))  # no prefill engines: never


def test_a_prefill_engine_is_picked_only_among_those_speaking_the_decode_engines_kv_protocol(engines):
    (native, _), (nixl, engine_nixl), (echo, engine_echo), (d, engine_d) = engines(4)
    for engine, connector in ((engine_nixl, "NixlConnector"), (engine_echo, "EchoConnector"),
                              (engine_d, "EchoConnector")):
        engine.kv_protocol, engine.kv_connector = engine_pb2.KV_TRANSFER_PROTOCOL_VLLM_CONNECTOR, connector
    long = generate_request([7] * 16)
    with EngineRouter([], prefill_engines=[native, nixl, echo], decode_engines=[d], pd_min_prompt_tokens=16,
                      policy="round_robin", load_interval=0.02) as router:
        decode = router.pick(long)
        assert (decode.kv_protocol, decode.kv_connector) == (engine_pb2.KV_TRANSFER_PROTOCOL_VLLM_CONNECTOR,
                                                             "EchoConnector")
        assert {router.pick(long, role="prefill", pair_with=decode).address for _ in range(6)} == {echo}
        assert {router.pick(long, role="prefill").address for _ in range(6)} == {native, nixl, echo}  # unpaired
    with EngineRouter([], prefill_engines=[native], decode_engines=[d], pd_min_prompt_tokens=16,
                      load_interval=0.02) as router:
        assert router.pick(long, role="prefill").kv_protocol == engine_pb2.KV_TRANSFER_PROTOCOL_TITO  # unspecified
        with pytest.raises(NoEngineAvailable, match="none speaks vLLM connector EchoConnector"):
            router.pick(long, role="prefill", pair_with=router.pick(long))


def test_a_prompt_its_decode_engine_mostly_holds_is_not_prefilled_elsewhere(engines):
    (p, _), (d, engine_d) = engines(2)
    history = list(range(100, 100 + 5 * BLOCK))  # 5 blocks cached on d
    engine_d.push(stored_batch(0, history, [b"d%d" % i for i in range(5)]))
    with EngineRouter([], prefill_engines=[p], decode_engines=[d], pd_min_prompt_tokens=2 * BLOCK,
                      load_interval=0.02) as router:
        follow_up = generate_request(history + [1] * (BLOCK + 1))  # 1 block + 1 token new
        wait_for(lambda: router.pick(follow_up).matched_blocks == 5, "d's events indexed")
        decode = router.pick(follow_up)
        assert decode.address == d and decode.matched_tokens == 5 * BLOCK
        assert not router.disaggregates(follow_up, decode)  # d computes the new part itself
        assert router.disaggregates(follow_up)  # with nothing cached it would be long enough
        fresh = generate_request([3] * (2 * BLOCK))
        assert router.disaggregates(fresh, router.pick(fresh))


def test_a_burst_of_requests_spreads_before_any_stream_starts(engines, monkeypatch):
    """A request sent to an engine (`reserve`) counts in its load at once: least load spreads a
    burst instead of sending it all to the engine that was idle before any of it started."""
    (a, engine_a), (b, engine_b) = engines(2)
    engine_a.load, engine_b.load = 0, 0
    chat = generate_request([7] * 12)
    with EngineRouter([a, b], policy="least_load", load_interval=0.02) as router:
        wait_for(lambda: all(router.status()[x]["reachable"] for x in (a, b)), "the loads polled")
        sent = []
        for _ in range(4):
            address = router.pick(chat).address
            router.reserve(address)
            sent.append(address)
        assert sorted(sent) == sorted([a, a, b, b])
        with router.track(a):  # the stream takes its reservation's place
            assert router.status()[a]["load"] == 2 and router.status()[a]["in_flight"] == 1
        monkeypatch.setattr(routing, "RESERVATION_SECONDS", 0.0)  # a request that never started stops counting
        assert router.status()[a]["load"] == 0 and router.status()[b]["load"] == 0


def test_an_engine_whose_events_stop_is_routed_by_load_until_they_resume(engines):
    (a, engine_a), (b, engine_b) = engines(2)
    engine_a.load, engine_b.load = 5, 0
    system = list(range(100, 112))
    engine_a.push(stored_batch(0, system, [b"a0", b"a1", b"a2"]))
    with EngineRouter([a, b], load_interval=0.02, retry_interval=0.05) as router:
        chat = generate_request(system + [1])
        wait_for(lambda: router.pick(chat).address == a, "a's prefix indexed")
        engine_a.fail()  # its stream ends; it still answers GetLoad
        wait_for(lambda: not router.status()[a]["events_live"], "a's events seen down")
        assert router.pick(chat).address == b  # by load only now
        # It comes back: the router resumes from the sequence after the last it applied.
        engine_a.push(stored_batch(1, list(range(112, 116)), [b"a3"], parent=b"a2"))
        wait_for(lambda: router.pick(chat).address == a, "a's events resumed")
        assert engine_a.starts[0] == 0 and 1 in engine_a.starts[1:]
        assert router.pick(generate_request(list(range(100, 116)) + [1])).matched_blocks == 4


def test_a_dropped_sequence_rebuilds_the_view_from_the_oldest_batch(engines):
    ((a, engine_a),) = engines(1)
    engine_a.oldest = 5  # the engine no longer has batches 0..4
    engine_a.batches = [stored_batch(5, list(range(100, 108)), [b"a0", b"a1"])]
    with EngineRouter([a], load_interval=0.02, retry_interval=0.05) as router:
        chat = generate_request(list(range(100, 108)) + [1])
        wait_for(lambda: router.pick(chat).matched_blocks == 2, "view rebuilt from the oldest batch")
        assert engine_a.starts[:2] == [0, 5]


def test_engines_come_and_go_with_dns_and_unreachable_ones_are_left_out(engines):
    (a, engine_a), (b, engine_b) = engines(2)
    resolved = {"addresses": [a]}
    router = EngineRouter("dns:///engines.example:50052", load_interval=0.02, resolve_interval=0.05,
                          resolver=lambda host, port: list(resolved["addresses"]))
    with router:
        assert router.addresses() == [a]
        resolved["addresses"] = [a, b]
        wait_for(lambda: sorted(router.addresses()) == sorted([a, b]), "b joined")
        resolved["addresses"] = [b]
        wait_for(lambda: router.addresses() == [b], "a left")
        assert router.pick(generate_request([1] * 8)).address == b
        engine_b.down = True
        router.mark_unreachable(b)  # e.g. a Generate failed with UNAVAILABLE; GetLoad fails too
        with pytest.raises(NoEngineAvailable):
            router.pick(generate_request([1] * 8))
        engine_b.down = False
        wait_for(lambda: router.status()[b]["reachable"], "b answered GetLoad again")
        assert router.pick(generate_request([1] * 8)).address == b


def test_chain_keys_start_from_the_adapter():
    tokens = list(range(10, 22))
    view = EngineView()
    view.apply(stored_batch(0, tokens, [b"x0", b"x1", b"x2"], lora_name="sql"))
    assert view.matched_blocks(request_keys(generate_request(tokens, lora_name="sql"), BLOCK)) == 3
    assert view.matched_blocks(request_keys(generate_request(tokens), BLOCK)) == 0  # the base model
    assert view.matched_blocks(request_keys(generate_request(tokens, lora_name="chat"), BLOCK)) == 0
    view.apply(stored_batch(1, list(range(22, 26)), [b"x3"], parent=b"x2"))  # continuations inherit it
    assert view.matched_blocks(request_keys(generate_request(list(range(10, 26)), lora_name="sql"), BLOCK)) == 4


def test_an_adapters_requests_go_where_it_is_held(engines):
    (a, engine_a), (b, engine_b), (c, engine_c) = engines(3)
    engine_a.load, engine_b.load, engine_c.load = 0, 5, 3
    engine_b.adapters, engine_c.adapters = ["sql"], ["sql", "chat"]
    system = list(range(100, 112))
    engine_b.push(stored_batch(0, system, [b"b0", b"b1", b"b2"], lora_name="sql"))
    with EngineRouter([a, b, c], load_interval=0.02) as router:
        wait_for(lambda: router.status()[b]["cached_blocks"] == 3, "b's events indexed")
        wait_for(lambda: router.pick(generate_request([1] * 8, lora_name="chat")).address == c, "c's adapters polled")
        assert router.pick(generate_request(system + [1], lora_name="sql")).address == b  # its prefix, though busier
        assert router.pick(generate_request([7] * 8, lora_name="sql")).address == c  # cold: the less loaded holder
        assert router.pick(generate_request(system + [1])).address == a  # the base model: anywhere, by load
        assert router.pick(generate_request([7] * 8, lora_name="nowhere")).address == a  # held nowhere: least load


def test_an_adapter_held_nowhere_is_loaded_once_on_the_least_loaded_engine(engines):
    (a, engine_a), (b, engine_b) = engines(2)
    engine_a.load, engine_b.load_seconds = 3, 0.3
    with EngineRouter([a, b], load_interval=0.02, lora_paths={"sql": "adapters/sql"}) as router:
        wait_for(lambda: router.status()[a]["load"] == 3, "a's load polled")
        choices = []

        def first_request() -> None:  # concurrent first requests, each waits for the adapter as a stream does
            choice = router.pick(generate_request([7] * 8, lora_name="sql"))
            router.adapter_ready(choice.address, "sql")
            choices.append(choice.address)

        threads = [threading.Thread(target=first_request) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert choices == [b] * 8
        assert (engine_a.loads, engine_b.loads) == ([], [("sql", "adapters/sql")])  # one load for all eight
        assert router.pick(generate_request([7] * 8, lora_name="sql")).adapter_load is None  # held now


def test_a_holder_without_room_sends_the_adapter_to_the_least_loaded_engine_which_loads_it(engines):
    (a, engine_a), (b, engine_b) = engines(2)
    engine_a.adapters, engine_a.capacity, engine_a.load, engine_b.load = ["sql"], 4, 3, 1
    with EngineRouter([a, b], load_interval=0.02, lora_paths={"sql": "sql"}) as router:
        wait_for(lambda: router.status()[a]["load"] == 3 and router.adapters() == ["sql"], "a polled")
        assert router.pick(generate_request([7] * 8, lora_name="sql")).address == a  # a has room: busier, no load
        engine_a.load = 4  # a full batch: a request there would wait
        wait_for(lambda: router.status()[a]["load"] == 4, "a's full batch polled")
        choice = router.pick(generate_request([7] * 8, lora_name="sql"))
        assert choice.address == b and choice.adapter_load is not None
        router.adapter_ready(b, "sql")
        assert engine_b.loads == [("sql", "sql")] and engine_a.loads == []


def test_a_refused_load_reaches_the_request_and_the_next_one_tries_again(engines):
    ((a, engine_a),) = engines(1)
    engine_a.refuse_loads = True
    with EngineRouter([a], load_interval=0.02, lora_paths={"sql": "../outside"}) as router:
        choice = router.pick(generate_request([7] * 8, lora_name="sql"))
        with pytest.raises(grpc.RpcError) as refused:
            router.adapter_ready(choice.address, "sql")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lora_path" in refused.value.details()
        assert router.pick(generate_request([7] * 8, lora_name="sql")).adapter_load is not None
        wait_for(lambda: len(engine_a.loads) == 2, "the second load")


def test_policy_names_are_checked():
    with pytest.raises(ValueError, match="cache_aware"):
        EngineRouter(["127.0.0.1:1"], policy="random")
