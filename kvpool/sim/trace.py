"""Request traces in the FAST'25 format: loading, validation, and the facts a replay needs.

A trace is one JSON object a line (../shared/data/README.md):

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`hash_ids` are prefix-chained ids of the prompt's 512-token blocks: equal ids at the same
position mean the same reusable block, and a request can reuse the KV cache of the longest
leading run of its ids that is cached. This module reads such a file into `TraceRequest`s in
timestamp order (stable: equal timestamps keep file order) and checks every line. It is not a
replay (replay.py) and knows nothing of caches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec

from kvpool.errors import InvalidParams

# Tokens per block in the FAST'25 traces (hash_ids has one id per 512 prompt tokens).
BLOCK_TOKENS = 512
# Bounds of what one trace may hold: the shipped trace has 3,993 requests of at most 374
# blocks; these leave room for the paper's larger traces while bounding a replay's memory.
TRACE_REQUESTS_MAX = 2_000_000
TRACE_LINE_SIZE_BYTES_MAX = 1 << 20
REQUEST_BLOCKS_MAX = 16_384  # one batch of keys (limits.BATCH_KEYS_MAX)


class TraceRequest(msgspec.Struct, frozen=True):
    """One request of a trace; field names are the trace's own.

    Fields:
        timestamp: arrival, ms after the first request.
        input_length: prompt tokens (the last block may be partial).
        output_length: generated tokens (not cached by the replay).
        hash_ids: one id per 512-token prompt block, prefix-chained.
    """

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]

    def block_tokens(self, index: int) -> int:
        """Prompt tokens in block `index` (512, or fewer in a partial last block)."""
        return min(BLOCK_TOKENS, self.input_length - index * BLOCK_TOKENS)

    def prefix_tokens(self, block_count: int) -> int:
        """Prompt tokens covered by the first `block_count` blocks."""
        return min(block_count * BLOCK_TOKENS, self.input_length)


_decoder = msgspec.json.Decoder(TraceRequest)


def parse_trace_lines(
    lines: Iterable[bytes | str], source: str = "<trace>", limit: int | None = None
) -> list[TraceRequest]:
    """Decode and check trace lines; blank lines are skipped. Returns them in file order.

    Raises:
        InvalidParams: a line that is not a request, or inconsistent (len(hash_ids) !=
            ceil(input_length / 512), negative fields), or more than TRACE_REQUESTS_MAX.
    """
    requests: list[TraceRequest] = []
    cap = TRACE_REQUESTS_MAX if limit is None else min(limit, TRACE_REQUESTS_MAX)
    for number, line in enumerate(lines, 1):
        if len(requests) >= cap:
            if limit is None:
                raise InvalidParams(f"{source}: more than {TRACE_REQUESTS_MAX} requests")
            break
        if isinstance(line, str):
            line = line.encode()
        if not line.strip():
            continue
        if len(line) > TRACE_LINE_SIZE_BYTES_MAX:
            raise InvalidParams(f"{source}:{number}: line longer than {TRACE_LINE_SIZE_BYTES_MAX} bytes")
        try:
            request = _decoder.decode(line)
        except msgspec.DecodeError as exc:
            raise InvalidParams(f"{source}:{number}: not a trace request: {exc}") from exc
        _check(request, f"{source}:{number}")
        requests.append(request)
    return requests


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a trace file in timestamp order (file order among equal timestamps).

    Args:
        path: a JSON-lines trace.
        limit: keep only the first `limit` lines (a prefix of the trace, for short runs).

    Raises:
        InvalidParams: the file cannot be read, or a line is malformed (see parse_trace_lines).
    """
    path = Path(path)
    try:
        with path.open("rb") as file:
            requests = parse_trace_lines(file, str(path), limit)
    except OSError as exc:
        raise InvalidParams(f"cannot read trace {path}: {exc}") from exc
    return sorted(requests, key=lambda request: request.timestamp)


def _check(request: TraceRequest, where: str) -> None:
    if request.timestamp < 0 or request.input_length <= 0 or request.output_length < 0:
        raise InvalidParams(f"{where}: negative timestamp or lengths, or an empty prompt")
    expected = -(-request.input_length // BLOCK_TOKENS)
    if len(request.hash_ids) != expected:
        raise InvalidParams(
            f"{where}: {len(request.hash_ids)} hash_ids for {request.input_length} tokens "
            f"(expected {expected})"
        )
    if len(request.hash_ids) > REQUEST_BLOCKS_MAX:
        raise InvalidParams(f"{where}: more than {REQUEST_BLOCKS_MAX} blocks")
    if len(set(request.hash_ids)) != len(request.hash_ids):
        raise InvalidParams(f"{where}: a hash id repeats within one request")


def unique_block_count(requests: Sequence[TraceRequest]) -> int:
    """Distinct blocks in the trace: the capacity at which nothing is ever evicted."""
    return len({block for request in requests for block in request.hash_ids})


def next_uses(requests: Sequence[TraceRequest]) -> list[list[int]]:
    """For each request and block position, the index of the next request that holds the
    same block, or len(requests) when none does (the future, for offline optima only)."""
    never = len(requests)
    following: dict[int, int] = {}
    result: list[list[int]] = [[] for _ in requests]
    for index in range(len(requests) - 1, -1, -1):
        ids = requests[index].hash_ids
        result[index] = [following.get(block, never) for block in ids]
        for block in ids:
            following[block] = index
    return result
