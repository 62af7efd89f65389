"""Prefill/decode at the scheduler and in the domain: the pin table (single use, expiry frees the
blocks), the export/import of blocks between two schedulers (the fake runner's cache holds the
tokens themselves, so a wrong block changes the output), and handle signing."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from tito.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable
from tito.v1 import engine_pb2
from tito_engine.core.kv_export import export_pinned
from tito_engine.core.messages import ExportKv
from tito_engine.kv_transfer import (HANDLE_FORGED, HANDLE_UNKNOWN, TRANSFER_FAILED, TRANSFER_MISMATCH,
                                     TRANSFER_UNSUPPORTED, HandleIssuer,
                                     ImportedKv, KvLayout, KvPinned, KvPinOrder, KvPrefill, block_checksum,
                                     prompt_digest)
from tito_engine.service import kv_peer
from tito_engine.backend.kv_transfers import KvTransfers
from tito_engine.scheduling.kv_pins import KvPinTable, Pin
from tito_engine.scheduling.scheduler import run_step

from fake_kv_runner import FakeRunner, drain, expected, request, scheduler_with

BLOCK = 4


def test_a_pin_is_taken_once_and_an_expired_one_is_gone():
    table = KvPinTable()
    table.add(Pin("a", (1, 2), 7, deadline=10.0))
    table.add(Pin("b", (3,), 2, deadline=5.0))
    assert table.pinned_blocks == 3 and table.next_deadline() == 5.0
    assert table.take("b", now=6.0) is None  # expired: not served, left for expire()
    assert [pin.transfer_id for pin in table.expire(now=6.0)] == ["b"]
    assert table.take("a", now=6.0).blocks == (1, 2)
    assert table.take("a", now=6.0) is None and len(table) == 0


def prefill_on(runner: FakeRunner, prompt: list[int], seconds: float = 30.0):
    scheduler = scheduler_with(runner)
    req = request(prompt, max_tokens=1)
    req.kv_pin = KvPinOrder("t-1", seconds)
    scheduler.add(req)
    tokens = drain(scheduler, runner)
    return scheduler, req, tokens[(req.request_id, 0)]


def test_a_prefill_keeps_its_prompt_blocks_pinned_until_pulled_then_frees_them():
    runner = FakeRunner(num_blocks=32, block_size=BLOCK)
    prompt = list(range(20, 31))  # 11 tokens: 3 blocks, the last one partial
    scheduler, req, first = prefill_on(runner, prompt)
    assert first == expected(prompt, 1)
    assert len(req.pinned.blocks) == 3 and scheduler.kv.num_used == 3
    export = export_pinned(scheduler.kv, ExportKv(0, "t-1", 1, 3, len(prompt)), now=0.0)
    assert export.first_block == 1 and len(export.blocks) == 2
    assert scheduler.kv.num_used == 0  # the pull released the pin
    with pytest.raises(FailedPrecondition) as caught:  # single use
        export_pinned(scheduler.kv, ExportKv(0, "t-1", 0, 3, len(prompt)), now=0.0)
    assert caught.value.reason == HANDLE_UNKNOWN


def test_an_unpulled_pin_frees_its_blocks_at_its_deadline():
    runner = FakeRunner(num_blocks=32, block_size=BLOCK)
    scheduler, req, _ = prefill_on(runner, list(range(20, 29)), seconds=0.5)
    assert scheduler.kv.num_used == 3
    assert scheduler.kv.expire_pins(req.pinned.deadline - 0.1) == 0 and scheduler.kv.num_used == 3
    assert scheduler.kv.expire_pins(req.pinned.deadline + 0.1) == 1 and scheduler.kv.num_used == 0


@pytest.mark.parametrize("cached_on_d", [0, 2])
def test_decode_from_pulled_blocks_computes_only_the_last_prompt_token(cached_on_d):
    prompt = list(range(40, 53))  # 13 tokens: 4 blocks
    p_runner = FakeRunner(num_blocks=32, block_size=BLOCK)
    p_scheduler, _, _ = prefill_on(p_runner, prompt)
    export = export_pinned(p_scheduler.kv, ExportKv(0, "t-1", cached_on_d, 4, len(prompt)), now=0.0)

    d_runner = FakeRunner(num_blocks=32, block_size=BLOCK)
    d_scheduler = scheduler_with(d_runner)
    if cached_on_d:  # D computed a prompt sharing the first blocks before
        d_scheduler.add(request(prompt[:cached_on_d * BLOCK] + [7, 8, 9]))
        drain(d_scheduler, d_runner)
        assert d_scheduler.kv.peek_cached_blocks(request(prompt)) == cached_on_d
        d_runner.plans.clear()
    decode = request(prompt, max_tokens=5)
    decode.imported_kv = ImportedKv(export.first_block, export.blocks)
    d_scheduler.add(decode)
    tokens = drain(d_scheduler, d_runner)
    assert tokens[(decode.request_id, 0)] == expected(prompt, 5)
    first_row = d_runner.plans[0].rows[0]
    assert (first_row.start, first_row.token_ids) == (len(prompt) - 1, prompt[-1:])
    # The pulled blocks joined D's prefix cache: a later prompt sharing them takes them from there.
    assert d_scheduler.kv.peek_cached_blocks(request(prompt + [5, 6, 7])) == len(prompt) // BLOCK


def test_an_import_the_prefix_cache_no_longer_backs_is_dropped_and_the_prompt_recomputed():
    prompt = list(range(40, 53))
    d_runner = FakeRunner(num_blocks=32, block_size=BLOCK)
    d_scheduler = scheduler_with(d_runner)
    decode = request(prompt, max_tokens=3)
    decode.imported_kv = ImportedKv(2, (b"\0" * d_runner.cache.block_bytes,) * 2)  # blocks 0-1 were to be cached
    d_scheduler.add(decode)
    assert drain(d_scheduler, d_runner)[(decode.request_id, 0)] == expected(prompt, 3)
    assert d_runner.plans[0].rows[0].start == 0


LAYOUT = KvLayout(num_layers=2, kv_heads=1, head_dim=8)
PINNED = KvPinned("t" * 32, 3, BLOCK, 11, "float32", LAYOUT, expires_at=2e9)


def issuer(keys=None, engine_id="engine-p") -> HandleIssuer:
    return HandleIssuer(engine_id, "fp", {"k1": b"s" * 32} if keys is None else keys, max_pin_seconds=30)


def test_a_signed_handle_verifies_and_any_changed_field_does_not():
    digest = prompt_digest(list(range(11)), "", "")
    handle = issuer().issue(PINNED, "req-1", digest)
    issuer().check_pull(handle, now=1e9)
    issuer().check_decode(handle, digest)
    for change in ({"transfer_id": "u" * 32}, {"block_count": 2}, {"expires_at": 3e9}, {"request_id": "x"}):
        with pytest.raises(PermissionDenied) as caught:
            issuer().check_pull(dataclasses.replace(handle, **change), now=1e9)
        assert caught.value.reason == HANDLE_FORGED
    with pytest.raises(PermissionDenied):
        issuer(keys={"k1": b"o" * 32}).check_decode(handle, digest)  # another key


def test_a_handle_is_refused_when_expired_from_elsewhere_or_for_another_prompt():
    digest = prompt_digest(list(range(11)), "", "")
    handle = issuer().issue(PINNED, "req-1", digest)
    with pytest.raises(FailedPrecondition, match="expired"):
        issuer().check_pull(handle, now=2e9 + 1)
    with pytest.raises(FailedPrecondition, match="issued by engine"):
        issuer(engine_id="engine-q").check_pull(handle, now=1e9)
    with pytest.raises(FailedPrecondition) as caught:
        issuer().check_decode(handle, prompt_digest(list(range(11)), "salt", ""))
    assert caught.value.reason == TRANSFER_MISMATCH
    unsigned = issuer(keys={}).issue(PINNED, "req-1", digest)
    assert unsigned.auth_tag == b"" and issuer(keys={}).check_pull(unsigned, now=1e9) is None


def test_pin_seconds_are_capped_at_the_engines():
    assert issuer().pin_order(KvPrefill(600.0)).seconds == 30
    assert issuer().pin_order(KvPrefill(None)).seconds == 30
    order = issuer().pin_order(KvPrefill(0.5))
    assert order.seconds == 0.5 and len(order.transfer_id) == 32
    for bad in (-1.0, float("nan")):
        with pytest.raises(InvalidArgument) as caught:
            issuer().pin_order(KvPrefill(bad))
        assert caught.value.field == "kv_transfer.prefill.pin_seconds"


def test_a_preempted_prompt_that_skipped_the_encoder_waits_for_its_rows_before_recomputing():
    runner = FakeRunner(num_blocks=5, block_size=BLOCK)
    scheduler = scheduler_with(runner)
    first, second = request([20, 21, 22, 23], max_tokens=10), request([30, 31, 32, 33], max_tokens=10)
    second.media_unencoded = "its validated items"  # as the core leaves them when it skipped the encoder
    scheduler.add(first)
    scheduler.add(second)
    for _ in range(30):
        run_step(scheduler, runner)
        if second.preemptions:
            break
    assert second.awaiting_media_rows and second in scheduler.waiting
    for _ in range(30):  # the first request finishes; the second is not admitted without its rows
        run_step(scheduler, runner)
    assert first.finished and second in scheduler.waiting and not second.is_running
    second.awaiting_media_rows = False  # the core encoded its items
    drain(scheduler, runner)
    assert second.finished and second.sequences[0].output_ids == expected([30, 31, 32, 33], 10)


def test_a_pull_past_the_pinned_blocks_is_the_callers_mistake_and_still_frees_the_pin():
    runner = FakeRunner(num_blocks=32, block_size=BLOCK)
    prompt = list(range(20, 31))
    scheduler, _, _ = prefill_on(runner, prompt)
    with pytest.raises(InvalidArgument) as caught:
        export_pinned(scheduler.kv, ExportKv(0, "t-1", 4, 3, len(prompt)), now=0.0)
    assert caught.value.field == "first_block" and scheduler.kv.num_used == 0


def test_a_damaged_block_fails_the_pull_as_unavailable():
    data = b"\1" * 64
    good = engine_pb2.PullKvBlocksResponse(block_index=2, data=data, byte_size=64, checksum=block_checksum(data))
    kv_peer._check_block(good, 2)
    for damaged in (dict(checksum=block_checksum(b"\2" * 64)), dict(byte_size=63), dict(block_index=3)):
        message = engine_pb2.PullKvBlocksResponse()
        message.CopyFrom(good)
        for name, value in damaged.items():
            setattr(message, name, value)
        with pytest.raises(Unavailable) as caught:
            kv_peer._check_block(message, 2)
        assert caught.value.reason == TRANSFER_FAILED


def test_a_backend_that_cannot_export_kv_refuses_transfers_by_name():
    handle = issuer().issue(PINNED, "req-1", prompt_digest([1], "", ""))
    transfers = KvTransfers(object(), issuer(), peers=None)  # the vllm backend has no export_kv
    with pytest.raises(FailedPrecondition) as caught:
        asyncio.run(transfers.export(handle, 0))
    assert caught.value.reason == TRANSFER_UNSUPPORTED and caught.value.field == "kv_transfer"
