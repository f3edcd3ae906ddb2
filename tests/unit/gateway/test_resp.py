"""The lean Redis connection's wire format: RESP replies parsed whole or reported incomplete, commands encoded as
bulk strings, and Redis URLs read as redis-py reads them."""

from __future__ import annotations

import pytest

from deepserve.gateway.resp import ProtocolError, RedisAddress, ReplyError, _Incomplete, encode_command, parse_reply


@pytest.mark.parametrize(
    ("wire", "reply"),
    [
        (b"+OK\r\n", "OK"),
        (b":42\r\n", 42),
        (b":-3\r\n", -3),
        (b"$5\r\nhello\r\n", "hello"),
        (b"$0\r\n\r\n", ""),
        (b"$-1\r\n", None),
        (b"*-1\r\n", None),
        (b"*0\r\n", []),
        (b"*2\r\n:0\r\n$3\r\n1.5\r\n", [0, "1.5"]),
        (b"*2\r\n*1\r\n:1\r\n$-1\r\n", [[1], None]),
        (b"$4\r\na\r\nb\r\n", "a\r\nb"),  # a bulk string holds CRLF
    ],
)
def test_replies_parse_to_python_values(wire: bytes, reply: object) -> None:
    assert parse_reply(wire) == (reply, len(wire))


def test_error_reply_is_returned_as_an_exception_value() -> None:
    reply, end = parse_reply(b"-NOSCRIPT No matching script.\r\n+OK\r\n")
    assert isinstance(reply, ReplyError) and reply.no_script and end == 31
    assert parse_reply(b"-NOSCRIPT No matching script.\r\n+OK\r\n", end) == ("OK", 36)
    assert not ReplyError("ERR wrong number of arguments").no_script


@pytest.mark.parametrize("wire", [b"", b"+OK", b"$5\r\nhel", b"$5\r\nhello", b"*2\r\n:1\r\n", b"*2\r\n:1\r\n$3\r\nab"])
def test_a_reply_not_all_arrived_is_incomplete(wire: bytes) -> None:
    with pytest.raises(_Incomplete):
        parse_reply(wire)


def test_bytes_that_are_not_resp_are_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="not RESP"):
        parse_reply(b"HTTP/1.1 400 Bad Request\r\n")


def test_commands_are_arrays_of_bulk_strings() -> None:
    assert encode_command(("EVALSHA", "ab", 2, "k", 1.5, b"\xff")) == (
        b"*6\r\n$7\r\nEVALSHA\r\n$2\r\nab\r\n$1\r\n2\r\n$1\r\nk\r\n$3\r\n1.5\r\n$1\r\n\xff\r\n"
    )
    assert encode_command(["SET", "é", ""]) == b"*3\r\n$3\r\nSET\r\n$2\r\n\xc3\xa9\r\n$0\r\n\r\n"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6380/2", RedisAddress("127.0.0.1", 6380, None, False, None, None, 2)),
        ("redis://localhost", RedisAddress("localhost", 6379, None, False, None, None, 0)),
        ("redis://:s%40cret@h:1/0", RedisAddress("h", 1, None, False, None, "s@cret", 0)),
        ("redis://alice:pw@h/5", RedisAddress("h", 6379, None, False, "alice", "pw", 5)),
        ("redis://h?db=4", RedisAddress("h", 6379, None, False, None, None, 4)),
        ("rediss://h:6390", RedisAddress("h", 6390, None, True, None, None, 0)),
        ("unix:///run/redis.sock?db=1", RedisAddress(None, 6379, "/run/redis.sock", False, None, None, 1)),
    ],
)
def test_urls_are_read_as_redis_py_reads_them(url: str, expected: RedisAddress) -> None:
    assert RedisAddress.from_url(url) == expected


@pytest.mark.parametrize(
    ("url", "message"), [("http://h:6379", "starts with redis://"), ("redis://:pw@h/x", "must be a number, not 'x'")]
)
def test_bad_urls_say_what_is_wrong(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RedisAddress.from_url(url)
