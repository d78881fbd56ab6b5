"""A head loaded on one thread drafts on another (a server's engine thread).

MLX keeps its streams per thread: an array left lazy on the thread that built it cannot be
evaluated on another ("There is no Stream(cpu, 0) in current thread"). `macfleet serve
--proposer eagle` failed every request that way: the draft vocabulary's rows of the embedding
were a lazy gather made when the head loaded."""

import threading

import mlx.core as mx
import numpy as np

from macfleet.distill.heads import config_for_verifier, save_head
from macfleet.engine.proposers.eagle.head import EagleHead, load_head
from macfleet.engine.models import load_model


def test_a_loaded_head_drafts_on_another_thread(tmp_path):
    lm = load_model("tiny:2:32")
    head = EagleHead(config_for_verifier(lm.model, lm.spec, feature_scale=1.0), lm.model)
    head.set_draft_vocab(np.arange(40))
    save_head(head, tmp_path / "h")
    loaded = load_head(tmp_path / "h", lm.model)
    got: dict[str, object] = {}

    def draft() -> None:
        try:
            h = mx.zeros((1, 1, lm.model.args.hidden_size))
            got["logits"] = np.array(loaded.draft_logits(h))
            got["id"] = int(loaded.draft_ids[3].item())
        except Exception as e:  # noqa: BLE001 - reported below
            got["error"] = e

    t = threading.Thread(target=draft)
    t.start()
    t.join(60)
    assert "error" not in got, got.get("error")
    assert got["logits"].shape[-1] == 40 and got["id"] == 3
