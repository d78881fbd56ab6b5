"""A batch of one's plain step (`generate --local`, a lone request on a server) attends
without a mask (engine/batch.py `unmasked`): every key is its own, and the select through a
mask of all True is the identity. The same bits as the masked flat path: logits and KV, a
second request arriving mid-answer (the batch grows to two rows at two lengths and masks
again), seeded draws."""

from __future__ import annotations

import numpy as np
import pytest

from macfleet.engine import batch as batch_mod
from macfleet.engine import fastmath
from macfleet.engine.batch import BatchKV, Segment, flat_forward, unmasked
from macfleet.engine.events import TokensCommitted
from macfleet.engine.models import load_model
from macfleet.engine.sampling import GREEDY, SamplingParams
from macfleet.serve.engine import EngineRequest
from test_batch_ahead import _clean, answers, serve

MODEL = "tiny:3"

pytestmark = pytest.mark.skipif(not fastmath.enabled(),
                                reason="the mask is left out only on the CPU's attention")


@pytest.fixture(scope="module")
def lm():
    return load_model(MODEL)


@pytest.fixture
def taken(monkeypatch):
    """Each `unmasked` decision the flat forward takes."""
    out = []
    monkeypatch.setattr(batch_mod, "unmasked",
                        lambda *a: out.append(unmasked(*a)) or out[-1])
    return out


@pytest.fixture
def masked(monkeypatch):
    """The flat path as before: every batched attention through its mask."""
    monkeypatch.setattr(batch_mod, "unmasked", lambda *a: False)


def test_the_mask_is_left_out_only_where_every_cell_sees_every_key():
    full = np.ones((1, 1, 7), dtype=bool)
    assert unmasked(full, True)
    assert unmasked(np.ones((3, 1, 7), dtype=bool), True)  # rows of one query, one length
    assert not unmasked(full, False)  # another attention: the mask stays
    ragged = full.copy()
    ragged[0, 0, 6] = False
    assert not unmasked(ragged, True)
    assert not unmasked(np.tril(np.ones((3, 3), dtype=bool))[None], True)  # a block's causal


def _steps(lm, n: int = 6) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """A prompt, then n plain steps alone, then a block of three: logits and the KV buffers."""
    m = lm.model
    store = BatchKV(len(m.layers))
    c = store.open()
    rng = np.random.default_rng(5)
    flat_forward(m, [Segment(tuple(rng.integers(0, lm.vocab_size, 29).tolist()), c, None)])
    out = [np.array(flat_forward(m, [Segment((int(t),), c, 0)])[0])
           for t in rng.integers(0, lm.vocab_size, n)]
    out.append(np.array(flat_forward(m, [Segment((3, 4, 5), c, 0)])[0]))
    kv = [np.array(a)[:, :, :c.offset] for a in store.state]
    return out, kv


def _same_bits(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(
        x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b))


def test_a_batch_of_ones_plain_steps_are_the_masked_flat_paths_bits(lm, taken, monkeypatch):
    fast_logits, fast_kv = _steps(lm)
    assert taken.count(True) == 6 and taken[-1] is False  # each step unmasked; the block not
    monkeypatch.setattr(batch_mod, "unmasked", lambda *a: False)
    slow_logits, slow_kv = _steps(lm)
    assert _same_bits(fast_logits, slow_logits)
    assert _same_bits(fast_kv, slow_kv)


@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_p=0.95,
                                                           seed=7)])
def test_a_request_arriving_mid_answer_is_answered_as_on_the_masked_path(lm, params, request):
    rng = np.random.default_rng(6)
    p0, p1 = (tuple(rng.integers(0, lm.vocab_size, n).tolist()) for n in (21, 9))
    late = EngineRequest(p1, params, 10)

    def during(i, ev, submit, handles):
        if i == 0 and isinstance(ev, TokensCommitted) and ev.block == 5:
            submit(late)

    reqs = [EngineRequest(p0, params, 24)]
    taken = request.getfixturevalue("taken")
    fast = serve(lm, reqs, ahead=True, during=during)
    # alone, then two rows at two lengths (masked), then alone again once the late one ends
    went = "".join("1" if t else "0" for t in taken)
    assert went.startswith("1111") and "0" in went and went.endswith("1")
    assert fast[0].kv_store.open_rows == 0
    request.getfixturevalue("masked")
    slow = serve(lm, reqs, ahead=True, during=during)
    assert _clean(fast[1]) == _clean(slow[1]) and fast[2] == slow[2]  # events, cache offsets
    # the late request's answer as it is alone
    assert answers(fast[1])[1] == answers(serve(lm, [late], ahead=True)[1])[0]
