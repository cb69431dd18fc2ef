"""The checker <-> candidate channel of the code sandbox: plain data over two pipes.

Standard library only: under bubblewrap this file sits next to the launcher at /kiln/ (see
`kiln.eval.sandbox_launcher`). One tagged-JSON line per request and per response; only exact
builtin types cross, and the checker rebuilds them as fresh objects, so nothing the candidate
defines (a class with a lying `__eq__`, a frame, a file) ever reaches the tests.
"""

from __future__ import annotations

import json
import os

MAX_MESSAGE = 16 << 20  # largest request/response line between checker and candidate


class CandidateGone(Exception):
    """The candidate process ended (or broke the protocol) before the tests finished."""


_SCALARS = (type(None), bool, int, float, str)


def encode(value):
    """Plain data to JSON-able form; tuples, dicts, sets and bytes are tagged objects."""
    kind = type(value)  # exact types: a subclass could override __eq__
    if kind in _SCALARS:
        return value
    if kind is list:
        return [encode(v) for v in value]
    if kind is tuple:
        return {"t": [encode(v) for v in value]}
    if kind is dict:
        return {"d": [[encode(k), encode(v)] for k, v in value.items()]}
    if kind in (set, frozenset):
        return {"s" if kind is set else "f": [encode(v) for v in value]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    raise TypeError(f"the sandbox passes only plain data between tests and candidate, not {kind.__name__}")


def decode(value):
    if type(value) in _SCALARS:
        return value
    if type(value) is list:
        return [decode(v) for v in value]
    if type(value) is dict and len(value) == 1:
        (tag, body), = value.items()
        if tag == "t" and type(body) is list:
            return tuple(decode(v) for v in body)
        if tag == "d" and type(body) is list and all(type(p) is list and len(p) == 2 for p in body):
            return {decode(k): decode(v) for k, v in body}
        if tag in ("s", "f") and type(body) is list:
            return (set if tag == "s" else frozenset)(decode(v) for v in body)
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "c" and type(body) is list and len(body) == 2:
            return complex(float(body[0]), float(body[1]))
    raise ValueError("not a tagged plain-data value")


def read_line(fd: int) -> bytes:
    """One message; the protocol is strictly request/response, so nothing follows it unasked."""
    chunks, size = [], 0
    while not chunks or not chunks[-1].endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_MESSAGE:
            raise CandidateGone(f"a message over {MAX_MESSAGE >> 20} MB")
    return b"".join(chunks)


def send(fd: int, message: dict) -> None:
    data = json.dumps(message, allow_nan=True).encode() + b"\n"
    while data:
        data = data[os.write(fd, data):]


def send_quietly(fd: int, message: dict) -> None:
    try:
        send(fd, message)
    except OSError:  # the checker is gone; the exit status still says what happened
        pass


def serve_calls(namespace: dict, cfg: dict) -> None:
    """Candidate role: answer one request line per call until the checker closes the pipe."""
    req, resp = cfg["req_fd"], cfg["resp_fd"]
    function = namespace.get(cfg["entry_point"])
    if not callable(function):
        send(resp, {"error": ["NameError", f"the completion defines no function {cfg['entry_point']!r}"]})
        raise SystemExit(0)
    send(resp, {"ready": True})
    while line := read_line(req):
        args, kwargs = decode(json.loads(line))
        try:
            message = {"ok": encode(function(*args, **kwargs))}
        except Exception as e:  # the tests may expect it: raised again in the checker
            message = {"raised": [type(e).__name__, str(e)[:2000]]}
        send(resp, message)


class Proxy:
    """The candidate as the tests see it: each call is a request to the candidate process."""

    def __init__(self, cfg: dict):
        self._req, self._resp, self._ready = cfg["req_fd"], cfg["resp_fd"], False
        self.__name__ = cfg["entry_point"]

    def _receive(self):
        line = read_line(self._resp)
        if not line:
            raise CandidateGone("the candidate process ended before the tests finished")
        try:
            message = json.loads(line)
        except ValueError:
            raise CandidateGone("the candidate sent an unreadable reply") from None
        if type(message) is not dict or len(message) != 1:
            raise CandidateGone("the candidate broke the reply protocol")
        return message

    def __call__(self, *args, **kwargs):
        if not self._ready:
            message = self._receive()
            error = message.get("error")
            if type(error) is list and len(error) == 2:
                raise _builtin_exception(*map(str, error))
            if message != {"ready": True}:
                raise CandidateGone("the candidate broke the reply protocol")
            self._ready = True
        try:
            send(self._req, encode([list(args), kwargs]))
        except BrokenPipeError:
            raise CandidateGone("the candidate process ended before the tests finished") from None
        message = self._receive()
        if "ok" in message:
            try:
                return decode(message["ok"])
            except (ValueError, TypeError, RecursionError):
                raise CandidateGone("the candidate returned something that is not plain data") from None
        if "raised" in message and type(message["raised"]) is list and len(message["raised"]) == 2:
            raise _builtin_exception(*map(str, message["raised"]))
        raise CandidateGone("the candidate broke the reply protocol")


def _builtin_exception(name: str, text: str) -> BaseException:
    import builtins

    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception) and kind is not AssertionError:
        try:
            return kind(text)
        except Exception:
            pass
    # Other types (and AssertionError: the candidate's own, not a failed test) become errors.
    return RuntimeError(f"the candidate raised {name}: {text}")
