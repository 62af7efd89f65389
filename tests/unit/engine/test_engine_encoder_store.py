"""The shared encoder-output directory (multimodal/encoder_store.py): atomic writes, verification
on read, keys that cannot escape the root, bounded size with LRU eviction across handles."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from tito.v1 import tensor_pb2
from tito_engine.multimodal.encoder_store import (EntryCorrupt, EntryMissing, SharedEncoderStore,
                                                  checksum_bytes)

F32 = tensor_pb2.DTYPE_FLOAT32
FP = "0123456789abcdef"


def rows(n: int, fill: int = 1) -> bytes:
    return bytes([fill]) * (n * 4 * 4)  # n rows of 4 float32


def store(root: Path, max_bytes: int = 1 << 20, fingerprint: str = FP) -> SharedEncoderStore:
    return SharedEncoderStore(root, max_bytes=max_bytes, model_fingerprint=fingerprint)


def key(name: str) -> str:
    return f"{FP}/{name}"


def test_round_trip_and_two_handles_share_identity_and_entries(tmp_path):
    a, b = store(tmp_path), store(tmp_path)
    assert a.store_id == b.store_id and a.store_id.startswith("ecdir-")
    assert a.uri == f"ecdir://{a.store_id}"
    header = a.put(key("aa" * 16), F32, (3, 4), rows(3))
    assert header.checksum == checksum_bytes(rows(3)) and header.byte_size == 48 and header.shape == (3, 4)
    got_header, data = b.get(key("aa" * 16))
    assert got_header == header and data == rows(3)
    assert b.header(key("aa" * 16)) == header
    assert list((tmp_path / "tmp").iterdir()) == []  # nothing left half-written


def test_missing_key(tmp_path):
    with pytest.raises(EntryMissing):
        store(tmp_path).get(key("bb" * 16))


def test_first_writer_wins(tmp_path):
    a, b = store(tmp_path), store(tmp_path)
    first = a.put(key("cc" * 16), F32, (2, 4), rows(2, fill=1))
    second = b.put(key("cc" * 16), F32, (2, 4), rows(2, fill=2))  # another engine's rounding
    assert second == first
    assert a.get(key("cc" * 16))[1] == rows(2, fill=1)


def test_concurrent_writers_of_one_key_leave_one_good_entry(tmp_path):
    handles = [store(tmp_path) for _ in range(4)]
    results = []

    def write(index: int) -> None:
        results.append(handles[index].put(key("dd" * 16), F32, (8, 4), rows(8, fill=index + 1)))

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1
    header, data = handles[0].get(key("dd" * 16))
    assert header == results[0] and checksum_bytes(data) == header.checksum


@pytest.mark.parametrize("name", ["../../../etc/passwd", "/abs/path", "a\x00b", "..", "x/" * 40])
def test_keys_cannot_escape_the_root(tmp_path, name):
    s = store(tmp_path / "store")
    path = s.path_for(f"{FP}/{name}")
    assert path.resolve().is_relative_to((tmp_path / "store" / "entries").resolve())
    s.put(f"{FP}/{name}", F32, (1, 4), rows(1))
    assert s.get(f"{FP}/{name}")[1] == rows(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_tampered_data_is_refused_and_removed(tmp_path):
    s = store(tmp_path)
    s.put(key("ee" * 16), F32, (2, 4), rows(2))
    path = s.path_for(key("ee" * 16))
    _flip_last_byte(path)
    with pytest.raises(EntryCorrupt, match="checksum"):
        s.get(key("ee" * 16))
    assert not path.exists()  # the next Encode writes a good one
    with pytest.raises(EntryMissing):
        s.get(key("ee" * 16))
    assert s.stats().corrupt == 1


def test_truncated_file_and_foreign_bytes_are_corrupt(tmp_path):
    s = store(tmp_path)
    s.put(key("f1" * 16), F32, (2, 4), rows(2))
    path = s.path_for(key("f1" * 16))
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(EntryCorrupt, match="data bytes"):
        s.get(key("f1" * 16))
    other = s.path_for(key("f2" * 16))
    other.parent.mkdir(parents=True, exist_ok=True)
    other.write_bytes(b"not an entry at all")
    with pytest.raises(EntryCorrupt, match="magic"):
        s.get(key("f2" * 16))


def test_an_entry_copied_under_another_key_is_refused(tmp_path):
    s = store(tmp_path)
    s.put(key("a1" * 16), F32, (2, 4), rows(2, fill=7))
    s.put(key("a2" * 16), F32, (2, 4), rows(2, fill=8))
    target = s.path_for(key("a2" * 16))
    target.write_bytes(s.path_for(key("a1" * 16)).read_bytes())  # a valid file, of the other key
    with pytest.raises(EntryCorrupt, match="another key"):
        s.get(key("a2" * 16))


def test_a_consistently_rewritten_entry_verifies_but_has_a_new_checksum(tmp_path):
    """What a stale descriptor meets: the file is valid, but not what the descriptor promised."""
    a, b = store(tmp_path), store(tmp_path)
    old = a.put(key("b1" * 16), F32, (2, 4), rows(2, fill=1))
    b.remove(key("b1" * 16))
    new = b.put(key("b1" * 16), F32, (2, 4), rows(2, fill=3))
    assert new.checksum != old.checksum and a.get(key("b1" * 16))[0].checksum == new.checksum


def test_size_is_bounded_least_recently_used_go_first(tmp_path):
    probe = store(tmp_path / "probe")
    probe.put(key("ff" * 16), F32, (64, 4), rows(64))
    entry = probe.path_for(key("ff" * 16)).stat().st_size  # one entry of 64 rows, on disk
    s = store(tmp_path / "s", max_bytes=int(4.5 * entry))  # 4 fit, 5 do not
    names = [f"{k:02x}" * 16 for k in range(3)]
    for name in names:
        s.put(key(name), F32, (64, 4), rows(64))
    past = time.time() - 100
    for k, name in enumerate(names):
        os.utime(s.path_for(key(name)), (past + k, past + k))
    s.get(key(names[0]))  # now the most recently used
    for k in range(3, 6):
        s.put(key(f"{k:02x}" * 16), F32, (64, 4), rows(64))
    assert s.stats().evictions == 2
    present = {name for name in names if s.path_for(key(name)).exists()}
    assert present == {names[0]}  # the two untouched old ones went, the one read lately stayed
    on_disk = sum(p.stat().st_size for p in (tmp_path / "s" / "entries").rglob("*.ec"))
    assert on_disk <= 4.5 * entry


def test_eviction_by_another_handle_is_seen_as_missing(tmp_path):
    a, b = store(tmp_path), store(tmp_path)
    a.put(key("c1" * 16), F32, (2, 4), rows(2))
    b.remove(key("c1" * 16))
    with pytest.raises(EntryMissing):
        a.get(key("c1" * 16))


def test_an_output_larger_than_the_bound_is_not_stored(tmp_path):
    s = store(tmp_path, max_bytes=100)
    assert s.put(key("d1" * 16), F32, (64, 4), rows(64)) is None
    with pytest.raises(EntryMissing):
        s.get(key("d1" * 16))


def test_a_directory_of_something_else_is_refused(tmp_path):
    (tmp_path / "store.json").write_text('{"format": 99}')
    with pytest.raises(ValueError, match="not a tito encoder store"):
        store(tmp_path)
