"""Just enough HPACK (RFC 7541) for a relay that splices HTTP/2 frames.

The relay advertises ``SETTINGS_HEADER_TABLE_SIZE = 0`` to both peers, so once each encoder has
applied it, every header block is self-contained: the relay can read a block without tracking
state, drop a block (a call it answers itself) or write its own, and neither peer's table moves.
Until a peer has applied the setting (its first blocks may race our SETTINGS frame), blocks are
decoded in order with a full stateful decoder.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import hpack
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.huffman_table import decode_huffman

Header = tuple[bytes, bytes]

_STATIC_TABLE_LEN = 61
_STATIC_PATH_INDEXES = {4: b"/", 5: b"/index.html"}
# grpc-go's default limit on a received header list; a header block longer than this (its
# encoded bytes are never more than the list they decode to) is no peer's.
MAX_HEADER_LIST = 16 * 1024 * 1024
_GRPC_STATUS = b"grpc-status"
_HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)
_GRPC_STATUS_HUFFMAN = _HUFFMAN.encode(_GRPC_STATUS)
# Header names looked up by block_value, Huffman-encoded.
_huffman_names: dict[bytes, bytes] = {}
# Trailer blocks repeat (one per status and message), so the status of each is looked up.
_status_cache: dict[bytes, int | None] = {}
_STATUS_CACHE_SIZE = 1024
# The longest key either cache keeps: a CRI path or a plain status is a few dozen bytes, and
# a peer's ever new long values (up to a whole header block each) must not stay for as long
# as the cache does.
_CACHED_KEY_MAX = 512


class HeaderBlockError(Exception):
    """A header block that cannot be decoded: a COMPRESSION_ERROR for the connection."""


def _read_int(block: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    mask = (1 << prefix_bits) - 1
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block):
            raise HeaderBlockError("truncated integer in header block")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos
        if shift > 28:
            raise HeaderBlockError("integer too large in header block")


def _string_span(block: bytes, pos: int) -> tuple[bool, int, int]:
    """(huffman, start, end) of the string literal at ``pos``."""
    if pos >= len(block):
        raise HeaderBlockError("truncated string in header block")
    huffman = bool(block[pos] & 0x80)
    length, start = _read_int(block, pos, 7)
    end = start + length
    if end > len(block):
        raise HeaderBlockError("string runs past the end of the header block")
    return huffman, start, end


def _string(block: bytes, pos: int) -> tuple[bytes, int]:
    huffman, start, end = _string_span(block, pos)
    raw = block[start:end]
    if huffman:
        try:
            raw = decode_huffman(raw)
        except hpack.HPACKDecodingError as exc:
            raise HeaderBlockError(f"bad Huffman string: {exc}") from exc
    return raw, end


def _fresh_decoder() -> hpack.Decoder:
    return hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)


def decode_block(block: bytes) -> list[Header]:
    """Every header of a self-contained block (one that uses no dynamic table entry)."""
    try:
        return [(bytes(n), bytes(v)) for n, v in _fresh_decoder().decode(block, raw=True)]
    except hpack.HPACKError as exc:
        raise HeaderBlockError(f"cannot decode header block: {exc}") from exc


class RequestBlockReader:
    """Reads the ``:path`` of each request header block one client's encoder produces."""

    def __init__(self) -> None:
        self._decoder: hpack.Decoder | None = _fresh_decoder()
        self._path_cache: dict[bytes, str] = {}
        self.last_headers: list[Header] | None = None

    @property
    def stateless(self) -> bool:
        """True once the client encodes without a dynamic table (blocks may be dropped)."""
        return self._decoder is None

    def path(self, block: bytes) -> str | None:
        """The block's ``:path``, or None if it has none (trailers).

        ``last_headers`` holds the whole decoded list when the block needed the stateful
        decoder, and None when only the path was read.
        """
        if self._decoder is not None:
            return self._path_stateful(block)
        self.last_headers = None
        try:
            return self._scan_path(block)
        except (IndexError, hpack.HPACKDecodingError) as exc:
            # A bad Huffman string or a block cut short: the client's, a connection error.
            raise HeaderBlockError(f"cannot read header block: {exc}") from exc

    def _path_stateful(self, block: bytes) -> str | None:
        assert self._decoder is not None
        try:
            headers = [(bytes(n), bytes(v)) for n, v in self._decoder.decode(block, raw=True)]
        except hpack.HPACKError as exc:
            raise HeaderBlockError(f"cannot decode header block: {exc}") from exc
        self.last_headers = headers
        if self._decoder.header_table_size == 0:
            # The client applied our zero-size table: nothing can ever be indexed again.
            self._decoder = None
        for name, value in headers:
            if name == b":path":
                return value.decode("ascii", "replace")
        return None

    def _scan_path(self, block: bytes) -> str | None:
        pos, end = 0, len(block)
        while pos < end:
            first = block[pos]
            if first & 0x80:  # indexed field
                index, pos = _read_int(block, pos, 7)
                if index in _STATIC_PATH_INDEXES:
                    return _STATIC_PATH_INDEXES[index].decode()
                if not 0 < index <= _STATIC_TABLE_LEN:
                    raise HeaderBlockError(f"header index {index} with an empty dynamic table")
                continue
            if first & 0xE0 == 0x20:  # dynamic table size update
                size, pos = _read_int(block, pos, 5)
                if size:
                    # A peer that raised its table again (against our setting): decode in
                    # order from here on; its table is empty at this point, so a fresh
                    # decoder is in step with it.
                    self._decoder = _fresh_decoder()
                    return self._path_stateful(block)
                continue
            prefix = 6 if first & 0x40 else 4
            name_index, pos = _read_int(block, pos, prefix)
            if name_index:
                if name_index > _STATIC_TABLE_LEN:
                    raise HeaderBlockError(f"name index {name_index} with an empty dynamic table")
                is_path = name_index in _STATIC_PATH_INDEXES
                is_pseudo = name_index <= 7
            else:
                name, pos = _string(block, pos)
                is_path = name == b":path"
                is_pseudo = name.startswith(b":")
            huffman, start, stop = _string_span(block, pos)
            if is_path:
                raw = block[pos:stop]
                path = self._path_cache.get(raw)
                if path is None:
                    value = decode_huffman(block[start:stop]) if huffman else block[start:stop]
                    path = value.decode("ascii", "replace")
                    if len(self._path_cache) < 4096 and len(raw) <= _CACHED_KEY_MAX:
                        self._path_cache[raw] = path
                return path
            if not is_pseudo:
                return None  # pseudo-headers come first; a request without :path has none
            pos = stop
        return None


def grpc_status(block: bytes) -> int | None:
    """The ``grpc-status`` of a self-contained trailer block, or None when it has none (or
    refers to a dynamic table entry, which a block encoded under a zero-size table cannot)."""
    try:
        return _status_cache[block]
    except KeyError:
        pass
    try:
        status = _scan_status(block)
    except (HeaderBlockError, IndexError, hpack.HPACKDecodingError):
        status = None
    if len(_status_cache) < _STATUS_CACHE_SIZE and len(block) <= _CACHED_KEY_MAX:
        _status_cache[block] = status
    return status


def _scan_status(block: bytes) -> int | None:
    value = _scan_value(block, _GRPC_STATUS, _GRPC_STATUS_HUFFMAN)
    if value is None:
        return None
    return int(value) if value.isdigit() and len(value) < 6 else None


def block_value(block: bytes, name: bytes) -> bytes | None:
    """The value of a header that has no static table entry (``grpc-encoding``) in a
    self-contained block, found without decoding the other fields; None when it has none.
    HeaderBlockError when the block is malformed."""
    encoded = _huffman_names.get(name)
    if encoded is None:
        encoded = _huffman_names[name] = _HUFFMAN.encode(name)
    try:
        return _scan_value(block, name, encoded)
    except (IndexError, hpack.HPACKDecodingError) as exc:
        raise HeaderBlockError(f"cannot read header block: {exc}") from exc


def _scan_value(block: bytes, name: bytes, name_huffman: bytes) -> bytes | None:
    pos, end = 0, len(block)
    while pos < end:
        first = block[pos]
        if first & 0x80:  # indexed field: the names looked up here have no static entry
            index, pos = _read_int(block, pos, 7)
            if index > _STATIC_TABLE_LEN:
                return None
            continue
        if first & 0xE0 == 0x20:  # dynamic table size update
            _, pos = _read_int(block, pos, 5)
            continue
        name_index, pos = _read_int(block, pos, 6 if first & 0x40 else 4)
        found = False
        if name_index:
            if name_index > _STATIC_TABLE_LEN:
                return None
        else:
            huffman, start, pos = _string_span(block, pos)
            found = block[start:pos] == (name_huffman if huffman else name)
        huffman, start, pos = _string_span(block, pos)
        if found:
            return decode_huffman(block[start:pos]) if huffman else block[start:pos]
    return None


def _int_bytes(value: int, prefix_bits: int, flags: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([flags | value])
    out = bytearray([flags | limit])
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_block(headers: Iterable[Header]) -> bytes:
    """A self-contained block: literal-without-indexing fields, so no peer's table moves."""
    out = bytearray()
    for name, value in headers:
        if name == b":status" and value == b"200":
            out.append(0x88)  # static entry 8; indexed fields do not touch the dynamic table
            continue
        out.append(0x00)
        out += _int_bytes(len(name), 7, 0)
        out += name
        out += _int_bytes(len(value), 7, 0)
        out += value
    return bytes(out)


def header_value(headers: Sequence[Header], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None
