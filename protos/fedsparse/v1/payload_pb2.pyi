from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ValueDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VALUE_DTYPE_UNSPECIFIED: _ClassVar[ValueDtype]
    VALUE_DTYPE_FP32: _ClassVar[ValueDtype]
    VALUE_DTYPE_FP16: _ClassVar[ValueDtype]
    VALUE_DTYPE_BF16: _ClassVar[ValueDtype]
    VALUE_DTYPE_INT8: _ClassVar[ValueDtype]
    VALUE_DTYPE_INT4: _ClassVar[ValueDtype]
    VALUE_DTYPE_INT2: _ClassVar[ValueDtype]
    VALUE_DTYPE_INT1: _ClassVar[ValueDtype]

class IndexEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INDEX_ENCODING_UNSPECIFIED: _ClassVar[IndexEncoding]
    INDEX_ENCODING_SEEDED_MASK: _ClassVar[IndexEncoding]
    INDEX_ENCODING_DENSE: _ClassVar[IndexEncoding]
    INDEX_ENCODING_COO_INT32: _ClassVar[IndexEncoding]
    INDEX_ENCODING_DELTA_VARINT: _ClassVar[IndexEncoding]
    INDEX_ENCODING_BITMAP: _ClassVar[IndexEncoding]

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_ZSTD: _ClassVar[Compression]
VALUE_DTYPE_UNSPECIFIED: ValueDtype
VALUE_DTYPE_FP32: ValueDtype
VALUE_DTYPE_FP16: ValueDtype
VALUE_DTYPE_BF16: ValueDtype
VALUE_DTYPE_INT8: ValueDtype
VALUE_DTYPE_INT4: ValueDtype
VALUE_DTYPE_INT2: ValueDtype
VALUE_DTYPE_INT1: ValueDtype
INDEX_ENCODING_UNSPECIFIED: IndexEncoding
INDEX_ENCODING_SEEDED_MASK: IndexEncoding
INDEX_ENCODING_DENSE: IndexEncoding
INDEX_ENCODING_COO_INT32: IndexEncoding
INDEX_ENCODING_DELTA_VARINT: IndexEncoding
INDEX_ENCODING_BITMAP: IndexEncoding
COMPRESSION_NONE: Compression
COMPRESSION_ZSTD: Compression

class SparseUpdate(_message.Message):
    __slots__ = ("format_version", "dense_size", "round", "index_encoding", "mask_seed", "keep", "value_dtype", "indices", "values", "value_scale", "compression", "value_block", "value_scales")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DENSE_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    INDEX_ENCODING_FIELD_NUMBER: _ClassVar[int]
    MASK_SEED_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    VALUE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    VALUE_SCALE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    VALUE_BLOCK_FIELD_NUMBER: _ClassVar[int]
    VALUE_SCALES_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    dense_size: int
    round: int
    index_encoding: IndexEncoding
    mask_seed: int
    keep: int
    value_dtype: ValueDtype
    indices: bytes
    values: bytes
    value_scale: float
    compression: Compression
    value_block: int
    value_scales: bytes
    def __init__(self, format_version: _Optional[int] = ..., dense_size: _Optional[int] = ..., round: _Optional[int] = ..., index_encoding: _Optional[_Union[IndexEncoding, str]] = ..., mask_seed: _Optional[int] = ..., keep: _Optional[int] = ..., value_dtype: _Optional[_Union[ValueDtype, str]] = ..., indices: _Optional[bytes] = ..., values: _Optional[bytes] = ..., value_scale: _Optional[float] = ..., compression: _Optional[_Union[Compression, str]] = ..., value_block: _Optional[int] = ..., value_scales: _Optional[bytes] = ...) -> None: ...
