"""EAGLE drafting: a one-layer head over the verifier's own hidden states drafts the next tokens.

head.py      the head (its config, weights, the verifier it was trained for, its eval record)
features.py  taps on the verifier's forward that keep its hidden states (F3), feature chunks
chain.py     EagleProposer: chains (`eagle`), many sessions' chains drafted together
load.py      `eagle[:PATH]` / `eagle2[:PATH]`: the head file (or the shipped one), loaded once
tree.py      EagleTreeProposer: EAGLE-2 dynamic trees (`eagle2`), sized by engine/tree_budget.py
f3codec.py   int8 + row scales for hidden states crossing to a proposer on another Mac

Training a head is not here: macfleet/distill/ (`macfleet distill`) imports this, never the
other way round.
"""
