import pytest
import torch

# Five completions, six positions, float64. Chosen so that every gate meets every case:
#   row 0: 4 tokens, positive advantage       row 3: 2 tokens, zero advantage
#   row 1: 6 tokens (truncated: no room left), negative advantage
#   row 2: empty completion (no tokens)        row 4: 3 tokens, negative advantage
MASK = [
    [1, 1, 1, 1, 0, 0],
    [1, 1, 1, 1, 1, 1],
    [0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0],
    [1, 1, 1, 0, 0, 0],
]
SEQ_ADV = [1.5, -0.8, 0.7, 0.0, -1.2]
# log(pi / pi_old) per token: inside and outside every clip band used in the tests, on both sides
LOG_RATIO = [
    [0.05, 0.35, -0.3, 0.1, 0.0, 0.0],
    [-0.3, 0.35, -0.05, 0.8, -0.9, 0.1],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.2, -0.2, 0.0, 0.0, 0.0, 0.0],
    [1.3, -0.45, 0.02, 0.0, 0.0, 0.0],
]


class Batch:
    def __init__(self, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.mask = torch.tensor(MASK, dtype=torch.float64)
        self.seq_adv = torch.tensor(SEQ_ADV, dtype=torch.float64)
        self.adv = self.seq_adv[:, None] * self.mask
        base = -torch.rand(5, 6, generator=gen, dtype=torch.float64) * 3 - 1.4  # old log-probs in (-4.4, -1.4)
        self.old_logp = base
        self.logp = (base + torch.tensor(LOG_RATIO, dtype=torch.float64)).requires_grad_(True)

    def rows(self):
        """(row, [token positions]) for every non-empty completion."""
        for i in range(self.mask.shape[0]):
            positions = [t for t in range(self.mask.shape[1]) if self.mask[i, t] > 0]
            if positions:
                yield i, positions


@pytest.fixture
def batch():
    return Batch()
