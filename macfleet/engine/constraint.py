"""Structured output: a grammar (JSON schema, JSON object, regex, Lark) as a mask on the
verifier's distribution, with llguidance (issue 32).

One `Constraint` per request follows the committed tokens. Every verify row is masked to what
the grammar allows after its path, and drafts are cut to what it accepts, so greedy output (and
the sampled distribution) is that of constrained plain decoding whatever was drafted; the
tokens the grammar forces are drafted for free. Why llguidance, and how chains, trees and
sampling keep that: docs/engine.md, "Structured output".
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from macfleet.engine.json_schema import with_json_options
from macfleet.engine.tree import TokenTree, graft

log = logging.getLogger(__name__)

JSON_OBJECT = "json_object"
JSON_SCHEMA = "json_schema"
REGEX = "regex"
LARK = "grammar"
KINDS = (JSON_OBJECT, JSON_SCHEMA, REGEX, LARK)
MAX_FORCED = 32  # forced tokens drafted per block at most


class GrammarError(ValueError):
    """A grammar llguidance cannot compile (the message says where)."""


@dataclass(frozen=True)
class Grammar:
    """What the answer must match: `kind` one of KINDS; `source` the JSON schema's text, the
    regex or the Lark grammar (empty for json_object)."""

    kind: str
    source: str = ""

    def llguidance(self) -> str:
        """The grammar in llguidance's own form."""
        from llguidance import LLMatcher

        if self.kind in (JSON_OBJECT, JSON_SCHEMA):
            return LLMatcher.grammar_from_json_schema(json_grammar_schema(self))
        if self.kind == REGEX:
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == LARK:
            return LLMatcher.grammar_from_lark(self.source)
        raise GrammarError(f"unknown grammar kind '{self.kind}' (one of {', '.join(KINDS)})")


def json_grammar_schema(grammar: Grammar) -> str:
    """A json_object or json_schema grammar's schema as llguidance gets it: with the JSON
    options (json_schema.py: compact or indented whitespace) unless it names its own."""
    schema = {"type": "object"} if grammar.kind == JSON_OBJECT else json.loads(grammar.source)
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    return schema_text(with_json_options(schema))


def grammar_error(grammar: Grammar, tokenizer=None) -> str | None:
    """Why llguidance cannot compile or run this grammar (None: it can): compiled, then run a
    few tokens in (`run_error`). Without the model's tokenizer, on a byte tokenizer."""
    from llguidance import LLMatcher

    try:
        text = grammar.llguidance()
    except (GrammarError, ValueError, TypeError) as e:
        return str(e)
    err = LLMatcher.validate_grammar(text, tokenizer)
    return err or run_error(text, tokenizer)


# -- the grammar probe ---------------------------------------------------------------------
# Whether a grammar runs within llguidance's limits, decided before a request is admitted.
# Some grammars compile and then fail a few tokens in, when a parser row outgrows the engine's
# limits (`start: "t0" | ... | "t1999"`: `ParserTooComplex`), and would end a request at once
# with an empty answer. So a grammar is also run: one path of up to `PROBE_STEPS` tokens (the
# forced ones, else the lowest allowed non-eos), every step's mask computed. Why one path and a
# byte tokenizer suffice: docs/engine.md, "Grammar probe".
PROBE_STEPS = 64  # tokens walked at most
_BYTE_EOS = 256


class TokenList:
    """A tokenizer llguidance reads as a list of token bytes with one end-of-sequence id (its
    `TokenizerWrapper` protocol); encode: text bytes -> token ids."""

    def __init__(self, tokens: list[bytes], eos: int,
                 encode: Callable[[bytes], list[int]]) -> None:
        self.tokens, self._encode = tokens, encode
        self.eos_token_id, self.bos_token_id = eos, None
        self.special_token_ids = [eos]

    def __call__(self, text: bytes) -> list[int]:
        return self._encode(text)


@functools.lru_cache(maxsize=1)
def byte_tokenizer():
    """256 one-byte tokens and an end-of-sequence."""
    import llguidance

    wrap = TokenList([bytes([i]) for i in range(256)] + [b"<|eos|>"], _BYTE_EOS, list)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrap), n_vocab=257)


def _failed(tokens: int, err: str) -> str:
    first = (err.strip().splitlines() or ["grammar engine error"])[0][:300]
    return f"the grammar engine fails {tokens} token{'' if tokens == 1 else 's'} in: {first}"


def run_error(text: str, tokenizer=None, steps: int = PROBE_STEPS) -> str | None:
    """The engine's error when a compiled grammar (llguidance's form) is run for up to `steps`
    tokens on one path (None: it ran, or ended, within its limits)."""
    from llguidance import LLMatcher

    ll = tokenizer if tokenizer is not None else byte_tokenizer()
    m = LLMatcher(ll, text, log_level=0)
    eos = set(int(t) for t in ll.eos_tokens)
    vocab = ll.vocab_size
    for step in range(steps):
        if m.is_error():
            return _failed(step, m.get_error())
        if m.is_stopped():
            return None
        forced = [int(t) for t in m.compute_ff_tokens()]
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")[:vocab]
        if m.is_error():
            return _failed(step, m.get_error())
        # the lowest allowed ids, enough of them to hold one that is not end-of-sequence
        allowed = [int(t) for t in np.flatnonzero(bits)[:len(eos) + 1] if int(t) not in eos]
        nxt = forced[:1] or allowed[:1]
        if not nxt:
            return None  # only end-of-sequence (or nothing) is allowed: the walk is over
        if not m.consume_token(nxt[0]):
            return _failed(step + 1, m.get_error())
    return None


# -- the tokenizer bridge ------------------------------------------------------------------
_bridges: dict[tuple[int, int], object] = {}
_bridges_lock = threading.Lock()


def bridge(tokenizer, vocab: int):
    """The llguidance tokenizer of a model's tokenizer, built once (seconds for a large
    vocabulary: callers build it off their event loop) and shared by every request."""
    key = (id(tokenizer), vocab)
    with _bridges_lock:
        got = _bridges.get(key)
        if got is not None:
            return got[1]
        import llguidance
        import llguidance.hf

        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
        if hasattr(hf, "backend_tokenizer"):
            ll = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos or None)
        else:  # no HF fast tokenizer (the tiny test models'): its decoded tokens
            def encode(text: bytes) -> list[int]:
                return list(tokenizer.encode(text.decode("utf-8", "replace"),
                                             add_special_tokens=False))

            end = eos[0] if eos else vocab - 1
            wrap = TokenList([tokenizer.decode([i]).encode() if i != end else b"<|eos|>"
                              for i in range(vocab)], end, encode)
            ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrap), n_vocab=vocab)
        _bridges[key] = (tokenizer, ll)  # the tokenizer held: its id stays its own
        return ll


# -- one request's constraint ---------------------------------------------------------------
class Constraint:
    """One request's grammar state (docs/engine.md, "Structured output")."""

    def __init__(self, grammar: Grammar, tokenizer, vocab: int) -> None:
        from llguidance import LLMatcher

        self.grammar, self.vocab = grammar, vocab
        ll = bridge(tokenizer, vocab)
        self.eos = frozenset(int(t) for t in ll.eos_tokens)
        self._m = LLMatcher(ll, grammar.llguidance(), log_level=0)
        if self._m.is_error():
            raise GrammarError(self._m.get_error())
        self.done = False
        self.failed = ""  # the grammar engine's error, when it entered one

    def _mask(self) -> np.ndarray:
        """The tokens allowed now, [V] bool."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)

    def masks(self, drafts: Sequence[int]) -> np.ndarray:
        """Allowed tokens at each row of a verify block [last token, *drafts]: [len(drafts) + 1,
        V] bool; the state is left as it was."""
        rows = np.zeros((len(drafts) + 1, self.vocab), dtype=bool)
        n = self.cut(drafts)  # all of them after `cut`; rows past a bad one stay empty
        for i in range(n + 1):
            rows[i] = self._mask()
            if i < n:
                self._m.consume_token(int(drafts[i]))
        self._m.rollback(n)
        if self._m.is_error():
            self._fail()
        return self._end_rows(rows)

    def _end_rows(self, rows: np.ndarray) -> np.ndarray:
        """`rows`, each that allows nothing (an error, a refused node) allowing eos only."""
        rows[np.ix_(~rows.any(axis=1), [t for t in self.eos if t < self.vocab])] = True
        return rows

    def cut(self, drafts: Sequence[int]) -> int:
        """How many of `drafts` the grammar accepts from here (never an end-of-sequence)."""
        drafts = [int(t) for t in drafts]
        end = next((i for i, t in enumerate(drafts) if t in self.eos), len(drafts))
        return self._m.validate_tokens(drafts[:end]) if end else 0

    def tree_masks(self, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """`masks` for a token tree (node 0 the root; parents precede children): row i the
        tokens allowed after node i's path [len(tokens), V] bool; a refused node and its
        subtree get the end row. The state is left as it was."""
        rows = np.zeros((len(tokens), self.vocab), dtype=bool)

        def at(i: int) -> None:
            rows[i] = self._mask()

        self._walk(tokens, parents, at)
        return self._end_rows(rows)

    def tree_accepts(self, tokens: Sequence[int], parents: Sequence[int]) -> list[bool]:
        """Which nodes of a token tree the grammar accepts along their path from the root
        (the root always; a refused node's subtree never; end-of-sequence never drafted)."""
        return self._walk(tokens, parents, lambda i: None)

    def _walk(self, tokens: Sequence[int], parents: Sequence[int], at) -> list[bool]:
        """Depth-first over a token tree, `at(i)` at every accepted node with the grammar's
        state after its path; a refused node is skipped with its subtree. One token check per
        node, rolled back between branches; the state is left as it was."""
        n = len(tokens)
        kids: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            kids[int(parents[i])].append(i)
        ok = [False] * n
        if not n:
            return ok
        ok[0] = True
        at(0)
        stack = [(c, 1) for c in reversed(kids[0])]
        depth = 0  # tokens consumed: the path of the last accepted node
        while stack:
            i, d = stack.pop()
            if depth >= d:  # back up to its parent (on the path: depth-first order)
                self._m.rollback(depth - d + 1)
                depth = d - 1
            t = int(tokens[i])
            if t in self.eos or self._m.validate_tokens([t]) != 1:
                continue
            if not self._m.consume_token(t):  # validated: an engine error
                self._fail()
                break
            depth = d
            ok[i] = True
            at(i)
            stack.extend((c, d + 1) for c in reversed(kids[i]))
        self._m.rollback(depth)
        return ok

    def forced(self) -> tuple[int, ...]:
        """The tokens the grammar forces next (none once it is complete)."""
        if self.done or self._m.is_stopped():
            return ()
        return tuple(int(t) for t in self._m.compute_ff_tokens()[:MAX_FORCED])

    def commit(self, tokens: Sequence[int]) -> int | None:
        """Advance over verified tokens; where the answer ends within them (None: it goes
        on): before an end-of-sequence token, or after the token that completes the grammar."""
        for i, t in enumerate(tokens):
            t = int(t)
            if t in self.eos:
                self.done = True
                return i
            if not self._m.consume_token(t):
                self._fail()
                self.done = True
                return i
            if self._m.is_stopped():
                self.done = True
                return i + 1
        return None

    def resume(self, tokens: Sequence[int]) -> None:
        """Advance over tokens committed before this constraint existed (a re-planned request);
        GrammarError, naming the token, when they do not follow the grammar."""
        tokens = [int(t) for t in tokens]
        end = self.commit(tokens)
        if end is None or end == len(tokens):  # goes on, or complete right after them
            return
        why = self.failed or ("an end-of-sequence token" if tokens[end] in self.eos
                              else "past the grammar's end")
        raise GrammarError(f"the answer's {len(tokens)} committed tokens do not follow the "
                           f"grammar: token {end} (id {tokens[end]}): {why}")

    def _fail(self) -> None:
        if not self.failed:
            self.failed = self._m.get_error() or "grammar engine error"
            log.warning("grammar constraint failed: %s", self.failed)


def constrained_draft(c: Constraint, tokens: Sequence[int], room: int) -> tuple[int, ...]:
    """A constrained session's draft: the forced tokens first, then what the drafter proposed
    past them when it proposed them too, cut to what the grammar accepts and to `room`."""
    if room <= 0:
        return ()
    forced = c.forced()
    tokens = tuple(int(t) for t in tokens)
    if forced:
        rest = tokens[len(forced):] if tokens[:len(forced)] == forced else ()
        tokens = forced + rest
    return tokens[:min(room, c.cut(tokens))]


def constrained_tree(c: Constraint, tree: TokenTree, room: int) -> TokenTree:
    """`constrained_draft` for a token tree: the forced tokens first, the drafted subtree
    grafted past them, refused nodes (with their subtrees) and nodes deeper than `room`
    dropped, and the draft probabilities too (exact-match acceptance)."""
    if room <= 0:
        return tree.keep([], probs=False)
    g = graft(tree, c.forced())
    ok = c.tree_accepts(g.tokens, g.parents)
    return g.keep([i for i in range(1, len(g.tokens)) if ok[i] and g.depths[i] <= room],
                  probs=False)


def schema_text(schema: dict) -> str:
    """A JSON schema as the text `Grammar.source` holds."""
    return json.dumps(schema, separators=(",", ":"))  # key order kept: properties' order


def masked_logits(c: Constraint | None, logits, drafts: Sequence[int]):
    """A verify block's logits [len(drafts) + 1, V] with what the grammar forbids at each row
    at -inf (unchanged without a constraint)."""
    return logits if c is None else _masked(logits, c.masks(drafts))


def masked_tree_logits(c: Constraint | None, logits, tree: TokenTree):
    """A token tree's verify rows (the first len(tree.tokens) of `logits`) with what the
    grammar forbids after each node's path at -inf; unchanged without a constraint."""
    if c is None:
        return logits
    return _masked(logits[:len(tree.tokens)], c.tree_masks(tree.tokens, tree.parents))


def _masked(logits, allowed: np.ndarray):
    import mlx.core as mx

    return mx.where(mx.array(allowed), logits, float("-inf"))
