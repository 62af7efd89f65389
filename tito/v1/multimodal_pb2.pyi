from tito.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    MODALITY_IMAGE: _ClassVar[Modality]
    MODALITY_VIDEO: _ClassVar[Modality]
    MODALITY_AUDIO: _ClassVar[Modality]

class MmPayload(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MM_PAYLOAD_UNSPECIFIED: _ClassVar[MmPayload]
    MM_PAYLOAD_TENSORS: _ClassVar[MmPayload]
    MM_PAYLOAD_METADATA: _ClassVar[MmPayload]
    MM_PAYLOAD_NONE: _ClassVar[MmPayload]
MODALITY_UNSPECIFIED: Modality
MODALITY_IMAGE: Modality
MODALITY_VIDEO: Modality
MODALITY_AUDIO: Modality
MM_PAYLOAD_UNSPECIFIED: MmPayload
MM_PAYLOAD_TENSORS: MmPayload
MM_PAYLOAD_METADATA: MmPayload
MM_PAYLOAD_NONE: MmPayload

class PlaceholderRange(_message.Message):
    __slots__ = ("offset", "length", "is_embed")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    IS_EMBED_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    is_embed: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., is_embed: _Optional[_Iterable[bool]] = ...) -> None: ...

class EncoderCacheDescriptor(_message.Message):
    __slots__ = ("store_id", "uri", "key", "dtype", "shape", "byte_size", "checksum", "model_fingerprint", "auth_tag", "auth_key_id")
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    AUTH_TAG_FIELD_NUMBER: _ClassVar[int]
    AUTH_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    store_id: str
    uri: str
    key: str
    dtype: _tensor_pb2.Dtype
    shape: _containers.RepeatedScalarFieldContainer[int]
    byte_size: int
    checksum: str
    model_fingerprint: str
    auth_tag: bytes
    auth_key_id: str
    def __init__(self, store_id: _Optional[str] = ..., uri: _Optional[str] = ..., key: _Optional[str] = ..., dtype: _Optional[_Union[_tensor_pb2.Dtype, str]] = ..., shape: _Optional[_Iterable[int]] = ..., byte_size: _Optional[int] = ..., checksum: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., auth_tag: _Optional[bytes] = ..., auth_key_id: _Optional[str] = ...) -> None: ...

class MultiModalItem(_message.Message):
    __slots__ = ("modality", "mm_hash", "placeholder", "kwargs", "metadata", "ec_descriptor", "auth_tag", "auth_key_id")
    class KwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _tensor_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    EC_DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    AUTH_TAG_FIELD_NUMBER: _ClassVar[int]
    AUTH_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    modality: Modality
    mm_hash: str
    placeholder: PlaceholderRange
    kwargs: _containers.MessageMap[str, _tensor_pb2.Tensor]
    metadata: _containers.MessageMap[str, _tensor_pb2.Tensor]
    ec_descriptor: EncoderCacheDescriptor
    auth_tag: bytes
    auth_key_id: str
    def __init__(self, modality: _Optional[_Union[Modality, str]] = ..., mm_hash: _Optional[str] = ..., placeholder: _Optional[_Union[PlaceholderRange, _Mapping]] = ..., kwargs: _Optional[_Mapping[str, _tensor_pb2.Tensor]] = ..., metadata: _Optional[_Mapping[str, _tensor_pb2.Tensor]] = ..., ec_descriptor: _Optional[_Union[EncoderCacheDescriptor, _Mapping]] = ..., auth_tag: _Optional[bytes] = ..., auth_key_id: _Optional[str] = ...) -> None: ...

class MultiModalFeatures(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[MultiModalItem]
    def __init__(self, items: _Optional[_Iterable[_Union[MultiModalItem, _Mapping]]] = ...) -> None: ...
