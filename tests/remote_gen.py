"""One generation on a verifier agent, as the agent tests read it: the streamed ids must add
up to the GenerateDone's (shared by tests/agents; tests/ is on sys.path, see conftest.py)."""

from __future__ import annotations

from bridge.messages import GenerateChunk, GenerateDone
from macfleet.fleet.client import generate_remote


def generate_done(card, key: bytes, prompt: str, eps: list[str], spec: str,
                  **kw) -> GenerateDone:
    done, ids = None, []
    for m in generate_remote(card, key, prompt=prompt, chat=False, proposers=eps,
                             proposer_spec=spec, **kw):
        if isinstance(m, GenerateChunk):
            ids += m.token_ids
        elif isinstance(m, GenerateDone):
            done = m
    assert done is not None and ids == done.token_ids
    return done
