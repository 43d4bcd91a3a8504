"""`python -m research.locret_heldout`: a heads file scored on a training set's last samples gives the training run's
own held-out figures (the same samples, the same loss)."""

from __future__ import annotations

import json
from collections import namedtuple

import numpy as np
import pytest

from research.locret_heldout import main
from tests.tiny import save_tiny

Sample = namedtuple("Sample", "prompt_ids answer_ids kind")


def test_heldout_scores_equal_the_training_runs(tmp_path, capsys):
    from kvjax.models import load_model
    from kvjax.train.dataset import build_dataset
    from kvjax.train.locret import TrainConfig, train

    save_tiny("qwen2", str(tmp_path / "model"), seed=4)
    model = load_model(str(tmp_path / "model"), "float32", tokenizer=False)
    rng = np.random.default_rng(1)
    samples = [Sample(tuple(rng.integers(0, 97, size=int(rng.integers(20, 30)))), tuple(rng.integers(0, 97, size=4)),
                      "test") for _ in range(6)]
    build_dataset(model, samples, tmp_path / "data", tokens=32, answer_max=8)
    metrics = train(tmp_path / "data", tmp_path / "run", TrainConfig(hidden=8, steps=3, heldout=2))
    assert main([str(tmp_path / "run" / "heads.npz"), str(tmp_path / "data"), "2"]) == 0
    scored = json.loads(capsys.readouterr().out)
    last = metrics["eval"][-1]
    assert scored["top10_overlap"] == round(last["top10_overlap"], 4)
    assert scored["loss"] == pytest.approx(round(last["loss"], 4), abs=2e-4)  # the heads file is float16
    with pytest.raises(SystemExit, match="between 1 and the set's 6 samples"):
        main([str(tmp_path / "run" / "heads.npz"), str(tmp_path / "data"), "7"])
