import pytest
import torch

from hexq.algos.importance import importance, importance_order


def test_importance_mixes_the_shares_of_counts_and_score_sums():
    counts = torch.tensor([6, 3, 1, 0])  # shares 0.6, 0.3, 0.1, 0
    score_sums = torch.tensor([1.0, 2.0, 1.0, 0.0])  # shares 0.25, 0.5, 0.25, 0
    S = importance(counts, score_sums, alpha=0.5)
    assert torch.allclose(S, torch.tensor([0.425, 0.4, 0.175, 0.0], dtype=torch.float64))
    assert importance_order(S) == [0, 1, 2, 3]
    # alpha picks one term alone: frequency puts expert 0 first, routing confidence puts expert 1 first.
    assert importance_order(importance(counts, score_sums, alpha=1.0)) == [0, 1, 2, 3]
    assert importance_order(importance(counts, score_sums, alpha=0.0)) == [1, 0, 2, 3]
    assert float(S.sum()) == pytest.approx(1.0)


def test_importance_does_not_depend_on_token_count_or_score_scale():
    counts = torch.tensor([5, 2, 9])
    score_sums = torch.tensor([0.4, 1.1, 2.0])
    assert torch.allclose(importance(counts, score_sums, 0.3), importance(counts * 7, score_sums * 100, 0.3))


def test_a_layer_without_tokens_gives_zero_importance_and_id_order():
    S = importance(torch.zeros(4, dtype=torch.long), torch.zeros(4))
    assert torch.equal(S, torch.zeros(4, dtype=torch.float64))
    assert importance_order(S) == [0, 1, 2, 3]


def test_importance_of_all_layers_at_once_normalizes_each_layer():
    counts = torch.tensor([[2, 2], [0, 0], [1, 3]])
    score_sums = torch.tensor([[1.0, 3.0], [0.0, 0.0], [1.0, 1.0]])
    S = importance(counts, score_sums)
    for layer in range(3):
        assert torch.equal(S[layer], importance(counts[layer], score_sums[layer]))
    assert torch.allclose(S[0], torch.tensor([0.375, 0.625], dtype=torch.float64))


def test_ties_are_broken_by_expert_id():
    assert importance_order(torch.tensor([0.1, 0.3, 0.1, 0.3, 0.2])) == [1, 3, 4, 0, 2]


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="alpha"):
        importance(torch.ones(3), torch.ones(3), alpha=1.5)
    with pytest.raises(ValueError, match="shape"):
        importance(torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError, match="non-negative"):
        importance(torch.tensor([1, -1]), torch.ones(2))
    with pytest.raises(ValueError, match="one layer"):
        importance_order(torch.ones(2, 3))
