"""Online lookups: entity rows -> one pipelined round trip -> values with true statuses.

Three steps, one module each, so the SDK (sync) and the servers (async) share everything but the
I/O: the plan (``OnlineQuery.prepare``: validate, build keys), the read (``OnlineReader``: the
store's round trips, heavy entities' tile summaries, storing new ones) and the assembly (decode,
ttl, windows, statuses) into the response (``OnlineResponse``).
"""

from featurestore.retrieval.online.plan import OnlineQuery, QueryTemplate
from featurestore.retrieval.online.reader import HeavyKeys, OnlineReader
from featurestore.retrieval.online.response import (
    NOT_FOUND,
    NULL_VALUE,
    OUTSIDE_MAX_AGE,
    PRESENT,
    OnlineResponse,
    json_number,
    json_numbers,
)

__all__ = [
    "NOT_FOUND",
    "NULL_VALUE",
    "OUTSIDE_MAX_AGE",
    "PRESENT",
    "HeavyKeys",
    "OnlineQuery",
    "OnlineReader",
    "OnlineResponse",
    "QueryTemplate",
    "json_number",
    "json_numbers",
]
