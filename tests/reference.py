"""The independent reference: a plain PyTorch training loop with no toolkit code in it.

Parity and resume tests compare what the toolkit's engines produce against this loop, so a bug shared by
every engine (they all build on `TorchEngine`) cannot cancel out: model, optimizer, loss, `backward` and
`step` over the same global batches, written out by hand.

    >>> weights, steps = parity_reference(global_batch=8, grad_accum=2)
"""

import torch

# The data and model of tests/scripts/parity.py: 64 samples of 8 features, 4 classes, seed 1234.
SAMPLES, FEATURES, CLASSES = 64, 8, 4


def parity_data():
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(SAMPLES, FEATURES, generator=generator), torch.randint(0, CLASSES, (SAMPLES,), generator=generator)


def parity_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, CLASSES))


def global_batches(epoch, global_batch, seed=0):
    """Index batches of one epoch: a permutation drawn from `seed + epoch` (what a shuffling distributed
    sampler draws on every rank), cut into consecutive global batches. Rank r of W takes every W-th index of
    the permutation, so a global batch is the same set of samples whatever the world size."""
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return [order[i:i + global_batch] for i in range(0, SAMPLES, global_batch)]


def train_by_hand(model, optimizer, batches, grad_accum=1, max_norm=None, lr_at=None):
    """Mean cross-entropy over each micro-batch, gradients summed over `grad_accum` micro-batches (each loss
    divided by grad_accum), then one optimizer step at learning rate lr_at(step) when given. Returns the
    number of optimizer steps taken."""
    steps = 0
    for micro, (x, y) in enumerate(batches, 1):
        loss = torch.nn.functional.cross_entropy(model(x), y) / grad_accum
        loss.backward()
        if micro % grad_accum == 0:
            if lr_at is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(steps)
            if max_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    return steps


def parity_reference(global_batch, grad_accum, epochs=2, max_norm=None, lr_at=None):
    """(final state dict, optimizer steps) of tests/scripts/parity.py's training, written by hand."""
    x, y = parity_data()
    model = parity_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    micro = [(x[i], y[i]) for epoch in range(epochs) for i in map(torch.tensor, global_batches(epoch, global_batch))]
    steps = train_by_hand(model, optimizer, micro, grad_accum, max_norm, lr_at)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, steps


def start_weights():
    return {k: v.detach().clone() for k, v in parity_model().state_dict().items()}
