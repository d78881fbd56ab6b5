"""The offline data factory behind `macfleet distill`: it trains a drafter for a verifier.

prompts.py, chat_prompts.py  training prompts from offline sources; the held-out requests
self_instruct.py             questions the verifier writes itself
batchgen.py                  the verifier's answers, generated in batches
dataset.py                   the memory-mapped dataset directory (answers, cached features)
data.py                      the small local set of the quick, dataset-less `distill`
train.py                     head training, acceptance figures
pipeline.py                  `distill`: dataset -> features -> trained head -> eval record, curve
contamination*.py            no training prompt is a near-copy of a held-out one

It imports the engine (the models, the EAGLE head of engine/proposers/eagle/); nothing in the
engine, the agents, the server, the wire or the dashboard imports it (tests/test_layering.py).
"""
