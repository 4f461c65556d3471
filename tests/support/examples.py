"""Ids whose parts are known from outside the code: written out, never generated, so a
bug in the generator or the decoder cannot rewrite what the tests expect."""

from __future__ import annotations

SEED_003_JSON: dict[str, object] = {
    "id": "910499571847892992",  # a string: JSON numbers lose precision above 2**53
    "time": "2017-09-20T13:43:08.849Z",
    "timestamp_ms": 1505914988849,
    "datacenter_id": 17,
    "worker_id": 25,
    "sequence": 0,
    "clock_sequence": 0,
}
"""The worked example of the seed article 003 (Twitter's layout, id 910499571847892992), as
``DecodedId.to_json``, ``snowflake decode --json`` and the decode vectors give it."""
