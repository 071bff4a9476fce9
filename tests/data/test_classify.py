"""ClassificationTask: an empty training split is one line saying what to give."""

from __future__ import annotations

import pytest
import torch

from mhsa.data.classify import ClassificationTask, split


def test_an_empty_training_split_is_a_clear_error():
    """One image per class all goes to the test split: the first training batch once
    raised torch's "random_ expects 'from' to be less than 'to'"."""
    x, y = torch.randn(2, 3), torch.tensor([0, 1])
    train, test = split(x, y, 0.2, seed=0)
    with pytest.raises(ValueError, match="no example is left to train on: all 2 went to the test"):
        ClassificationTask(train, test, batch_size=2)
    x, y = torch.randn(10, 3), torch.tensor([0, 1] * 5)
    task = ClassificationTask(*split(x, y, 0.2, seed=0), batch_size=2)
    assert len(task.train_batch(torch.Generator().manual_seed(0))[-1]) == 2
