"""zstd frames as the format accepts them (spec section 3), on the Python reference path.

The C engine (csrc/reader.c) checks a frame's header before decoding it; `decode` makes the
same checks in the same order and gives the same words (`native_messages` too, for the
engine's reasons), then decodes the frame one-shot into exactly the chunk's raw bytes and
un-shuffles them where the chunk is shuffled.  A frame refused is a `FrameError` carrying
the message; the chunk reader names path, key, chunk and offset around it.
"""

from __future__ import annotations

from ..format import layout as fmt

#: zstd window limit: frames needing more memory than this are rejected (2**27 = 128 MiB)
MAX_WINDOW = 1 << fmt.ZSTD_WINDOW_LOG_MAX
#: the magic number of a zstd frame (RFC 8878); legacy (pre-1.0) and skippable frames differ
MAGIC = b"\x28\xb5\x2f\xfd"
# the messages both engines give for a zstd frame the format refuses (spec section 3)
NOT_A_FRAME = "not a zstd frame (legacy, skippable or unknown magic number)"
UNDECODABLE = "zstd data does not decode"
NO_SIZE = "zstd frame does not declare its decoded size"


def window_msg(window: int) -> str:
    return f"zstd frame needs a window of {window} bytes, above the limit {MAX_WINDOW}"


def dict_msg(dict_id: int) -> str:
    return f"zstd frame needs dictionary {dict_id}; the format uses none"


def declared_msg(declared: int, raw_len: int) -> str:
    return f"zstd frame declares {declared} bytes, the index {raw_len}"


def decoded_msg(decoded: int, raw_len: int) -> str:
    return f"zstd data decodes to {decoded} bytes, expected {raw_len}"


class FrameError(Exception):
    """A zstd frame the format refuses, or that does not decode: the message says which."""


def decode(stored: memoryview, dest: memoryview, shuffled: bool, width: int) -> None:
    """Decode the frame `stored` into `dest` (exactly the chunk's raw bytes), un-shuffling
    `width`-byte elements where `shuffled`; FrameError where the format refuses the frame."""
    import zstandard  # the reference path's only: the C engine decodes zstd itself (5 ms to import)

    raw_len = len(dest)
    # the frame header checks of the C engine (reader.c), in the same order and words
    if bytes(stored[:4]) != MAGIC:
        raise FrameError(NOT_A_FRAME)
    try:
        params = zstandard.get_frame_parameters(stored)
    except zstandard.ZstdError as e:
        raise FrameError(UNDECODABLE) from e
    if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
        raise FrameError(NO_SIZE)
    if params.content_size != raw_len:
        raise FrameError(declared_msg(params.content_size, raw_len))
    if params.window_size > MAX_WINDOW:
        raise FrameError(window_msg(params.window_size))
    if params.dict_id:
        raise FrameError(dict_msg(params.dict_id))
    try:
        # one-shot decoding: the buffer is exactly raw_len; a content checksum, if the
        # frame has one, is verified (as in C)
        dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        out = dctx.decompress(stored, max_output_size=raw_len, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise FrameError(UNDECODABLE) from e
    if len(out) != raw_len:
        raise FrameError(decoded_msg(len(out), raw_len))
    if shuffled:
        import numpy as np  # the reference path un-shuffles with numpy; the C engine needs none

        planes = np.frombuffer(out, dtype=np.uint8).reshape(width, raw_len // width)
        np.frombuffer(dest, dtype=np.uint8).reshape(raw_len // width, width)[...] = planes.T
    else:
        dest[:] = out
