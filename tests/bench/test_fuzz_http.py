"""The HTTP door of the fuzz campaign, against a real `macfleet serve` process."""

from __future__ import annotations

import random

import httpx
import pytest

from macfleet.bench.fuzz_http import CATEGORIES, http_door, typed


def _resp(status: int, body) -> httpx.Response:
    return httpx.Response(status, json=body)


def test_a_refusal_counts_only_when_it_is_openai_shaped():
    err = {"error": {"message": "m", "type": "invalid_request_error", "param": None,
                     "code": None}}
    assert typed("broken_json", _resp(400, err))
    assert not typed("broken_json", _resp(500, err))  # a server error is not a refusal
    assert not typed("broken_json", _resp(400, {"detail": "x"}))  # not OpenAI's shape
    assert not typed("no_key", _resp(200, {"choices": []}))  # answered without the key
    assert typed("valid", _resp(200, {"choices": []})) and not typed("valid", _resp(400, err))


@pytest.mark.slow  # starts a `macfleet serve` process and fuzzes it
def test_hostile_requests_get_typed_refusals_and_the_server_survives():
    res = http_door(2, random.Random(0))
    assert res["crashes"] == 0 and res["hangs"] == 0 and res["alive_at_end"]
    assert set(res["categories"]) == set(CATEGORIES)
    assert res["untyped"] == 0, {k: v for k, v in res["categories"].items() if v["untyped"]}
    assert res["categories"]["valid"]["replies"] == {"200": 2}
    assert res["categories"]["no_key"]["replies"] == {"401": 2}
