import numpy as np

from tito import signing, tensors
from tito.v1 import multimodal_pb2

KEY = b"k" * 32


def _item() -> multimodal_pb2.MultiModalItem:
    item = multimodal_pb2.MultiModalItem(modality=multimodal_pb2.MODALITY_IMAGE, mm_hash="ab" * 32,
                                         placeholder={"offset": 3, "length": 4, "is_embed": [True, False, True, True]})
    item.kwargs["pixel_values"].CopyFrom(tensors.from_numpy(np.arange(12, dtype=np.float32).reshape(3, 4)))
    item.metadata["image_grid_thw"].CopyFrom(tensors.from_numpy(np.array([1, 2, 2], dtype=np.int64)))
    return item


def test_signed_item_verifies_and_any_change_breaks_it():
    item = _item()
    signing.sign_item(item, KEY, "k1")
    assert signing.verify_item(item, {"k1": KEY})
    assert not signing.verify_item(item, {"k1": b"x" * 32})
    assert not signing.verify_item(item, {"other": KEY})
    for mutate in (
        lambda i: setattr(i, "mm_hash", "cd" * 32),
        lambda i: setattr(i.placeholder, "offset", 4),
        lambda i: i.placeholder.is_embed.__setitem__(1, True),
        lambda i: setattr(i.kwargs["pixel_values"], "data", b"\x00" * 48),
        lambda i: i.metadata["image_grid_thw"].shape.__setitem__(0, 1),
        lambda i: setattr(i.ec_descriptor, "key", "forged"),
    ):
        forged = multimodal_pb2.MultiModalItem()
        forged.CopyFrom(item)
        mutate(forged)
        assert not signing.verify_item(forged, {"k1": KEY})


def test_unsigned_item_does_not_verify():
    assert not signing.verify_item(_item(), {"": KEY})


def test_key_file_is_stripped_and_must_be_long_enough(tmp_path):
    import pytest

    from tito.config import ConfigError

    good = tmp_path / "key"
    good.write_text("0123456789abcdef0123\n")
    assert signing.read_key_file(str(good)) == b"0123456789abcdef0123"
    short = tmp_path / "short"
    short.write_text("tiny\n")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        signing.read_key_file(str(short))
    with pytest.raises(ConfigError, match="cannot be read"):
        signing.read_key_file(str(tmp_path / "missing"))


def _descriptor() -> multimodal_pb2.EncoderCacheDescriptor:
    return multimodal_pb2.EncoderCacheDescriptor(
        store_id="ecdir-0123456789abcdef", uri="ecdir://ecdir-0123456789abcdef", key="fp/" + "ab" * 32, dtype=1,
        shape=[4, 64], byte_size=1024, checksum="sha256:" + "0" * 64, model_fingerprint="fp")


def test_a_descriptor_signed_by_the_encoding_engine_verifies_and_any_change_breaks_it():
    descriptor = _descriptor()
    signing.sign_descriptor(descriptor, KEY, "k1")
    assert signing.verify_descriptor(descriptor, {"k1": KEY})
    assert not signing.verify_descriptor(descriptor, {"k1": b"x" * 32})
    for field, value in (("store_id", "ecdir-ffffffffffffffff"), ("uri", "ecdir://x"), ("key", "fp/" + "cd" * 32),
                         ("byte_size", 2048), ("checksum", "sha256:" + "1" * 64), ("model_fingerprint", "other")):
        changed = multimodal_pb2.EncoderCacheDescriptor()
        changed.CopyFrom(descriptor)
        setattr(changed, field, value)
        assert not signing.verify_descriptor(changed, {"k1": KEY}), field
    unsigned = _descriptor()
    assert not signing.verify_descriptor(unsigned, {"": KEY})


def test_an_item_signed_before_encoding_verifies_with_a_signed_descriptor_attached():
    item = _item()
    item.ClearField("kwargs")
    signing.sign_item(item, KEY, "k1")  # render, METADATA, before any engine encoded it
    descriptor = _descriptor()
    signing.sign_descriptor(descriptor, KEY, "k1")  # the engine that answered Encode
    item.ec_descriptor.CopyFrom(descriptor)  # a router attaches it
    assert signing.verify_item(item, {"k1": KEY})
    item.ec_descriptor.ClearField("auth_tag")  # an unsigned descriptor must be covered by the item's tag
    assert not signing.verify_item(item, {"k1": KEY})
    signing.sign_item(item, KEY, "k1")  # ... as when whoever attached it re-signed the item
    assert signing.verify_item(item, {"k1": KEY})


def test_item_bytes_with_a_descriptor_are_unchanged_by_descriptor_tags():
    """Render's signed bytes (descriptor included) do not depend on the descriptor's own tag fields."""
    item = _item()
    item.ec_descriptor.CopyFrom(_descriptor())
    before = signing.signed_bytes(item)
    signing.sign_descriptor(item.ec_descriptor, KEY, "k1")
    assert signing.signed_bytes(item) == before


def test_enum_numbers_outside_their_enum_sign_like_any_other_value():
    """Enums are open int32s on the wire: a caller may send -1 as a modality or a dtype. The tag
    covers the number like any other value (it once raised struct.error: INTERNAL)."""
    for change in (lambda i: setattr(i, "modality", -1), lambda i: setattr(i.ec_descriptor, "dtype", -1),
                   lambda i: setattr(i.kwargs["pixel_values"], "dtype", -(2**31))):
        item = _item()
        item.ec_descriptor.CopyFrom(_descriptor())
        signing.sign_item(item, KEY, "k1")
        change(item)
        assert not signing.verify_item(item, {"k1": KEY})
        signing.sign_item(item, KEY, "k1")
        assert signing.verify_item(item, {"k1": KEY})
    descriptor = _descriptor()
    descriptor.dtype = -1
    signing.sign_descriptor(descriptor, KEY, "k1")
    assert signing.verify_descriptor(descriptor, {"k1": KEY})
