"""Raw HTTP/2 over a plain socket, for tests that must behave as no gRPC client would: the
connection preface, SETTINGS, HEADERS with HPACK literal headers, DATA and RST_STREAM, as
RFC 9113 and RFC 7541 write them. Only what the tests need: no HPACK table, no flow control,
no frames read back beyond what `read_frames` returns."""

import socket
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, RST_STREAM, SETTINGS, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x7
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1
CANCEL = 0x8


def frame(kind, flags, stream_id, payload=b""):
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + \
        struct.pack(">I", stream_id & 0x7fffffff) + payload


def _hpack_int(value, prefix_bits, first=0):
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append(value % 128 + 128)
        value //= 128
    out.append(value)
    return bytes(out)


def hpack_literal(name, value):
    """A literal header field without indexing, new name (RFC 7541 6.2.2), no Huffman."""
    name, value = name.encode(), value.encode()
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


def grpc_headers(path, authority="localhost"):
    return b"".join(hpack_literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority),
        ("content-type", "application/grpc"), ("te", "trailers")))


def grpc_message(payload):
    return b"\x00" + struct.pack(">I", len(payload)) + payload


def connect(address, timeout=5.0, settings=True):
    """A connected socket that sent the preface (and an empty SETTINGS frame). address is
    (host, port) for TCP or a path for a unix socket."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(address)
    s.sendall(PREFACE + (frame(SETTINGS, 0, 0) if settings else b""))
    return s


def read_frames(s, timeout=1.0):
    """Frames the peer sent until it is quiet for `timeout` or closes: [(type, flags, id,
    payload)], and whether it closed."""
    s.settimeout(timeout)
    buf = b""
    closed = False
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                closed = True
                break
            buf += chunk
    except (socket.timeout, BlockingIOError):
        pass
    except (ConnectionResetError, BrokenPipeError):
        closed = True
    frames = []
    while len(buf) >= 9:
        n = int.from_bytes(buf[:3], "big")
        if len(buf) < 9 + n:
            break
        frames.append((buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7fffffff,
                       buf[9:9 + n]))
        buf = buf[9 + n:]
    return frames, closed
