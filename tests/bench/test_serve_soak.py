"""The API soak against a real `macfleet serve` process: answers checked, not only counted, and
the server's RSS and open files measured before and after."""

from __future__ import annotations

import random

import pytest

from macfleet.bench.serve_soak import PROMPTS, one, soak


@pytest.mark.slow
def test_a_soak_checks_every_answer_and_measures_rss_and_open_files():
    res = soak("tiny:1", 40, 4, 120, lambda m: None)
    assert res["requests"] == 40 and res["failed"] == 0 and res["server_alive_at_end"]
    assert res["sessions_left_at_end"] == 0
    assert res["rss_before_mib"] > 0 and res["fds_before"] > 0
    assert res["flat"] is (res["rss_growth"] < res["max_rss_growth"]
                           and 0 <= res["fds_after"] <= res["fds_before"])


def test_a_wrong_answer_is_a_failure(monkeypatch):
    """An answer that differs from the prompt's reference fails, whatever its status."""
    import httpx

    class R:
        status_code = 200

        @staticmethod
        def json():
            return {"usage": {"completion_tokens": 3},
                    "choices": [{"message": {"content": "not the answer"}}]}

    monkeypatch.setattr(httpx, "post", lambda *a, **k: R())
    want = {p: "the answer" for p in PROMPTS}
    assert not one("http://x/v1", "ok", random.Random(0), want)
    assert one("http://x/v1", "ok", random.Random(0), {p: "not the answer" for p in PROMPTS})
