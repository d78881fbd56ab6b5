"""EAGLE drafting: a one-layer head over the verifier's own hidden states drafts the next tokens
(head.py; features.py: the taps; chain.py: `eagle`; tree.py: `eagle2`; load.py; f3codec.py).
Training is macfleet/distill/, which imports this, never the other way round."""
