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


def global_batches(epoch, global_batch, seed=0, samples=SAMPLES):
    """Index batches of one epoch: a permutation drawn from `seed + epoch` (what a shuffling distributed
    sampler draws on every rank, and what the recipe's in-memory loader documents for seed 0), cut into
    consecutive global batches. Rank r of W takes every W-th index of the permutation, so a global batch is
    the same set of samples whatever the world size."""
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return [order[i:i + global_batch] for i in range(0, samples, global_batch)]


def train_by_hand(model, optimizer, batches, grad_accum=1, max_norm=None, lr_at=None, label_smoothing=0.0,
                  losses=None):
    """Mean cross-entropy over each micro-batch, gradients summed over `grad_accum` micro-batches (each loss
    divided by grad_accum), then one optimizer step at learning rate lr_at(step) when given (a peak lr times
    a factor). Returns the number of optimizer steps taken; appends each micro-batch's loss to `losses`."""
    steps = 0
    for micro, (x, y) in enumerate(batches, 1):
        loss = torch.nn.functional.cross_entropy(model(x), y, label_smoothing=label_smoothing)
        if losses is not None:
            losses.append(loss.item())
        (loss / grad_accum).backward()
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


# ----------------------------------------------------------------------------- recipes/cifar.py, by hand

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)  # as the recipe's docs give them


def read_cifar10(root):
    """(train x, train y, test x, test y) of ROOT/cifar-10-batches-py: uint8 N x 3 x 32 x 32 and int64 N."""
    import pickle
    from pathlib import Path

    def read(names):
        batches = [pickle.loads((Path(root) / "cifar-10-batches-py" / name).read_bytes()) for name in names]
        x = torch.cat([torch.as_tensor(b[b"data"]).reshape(-1, 3, 32, 32) for b in batches])
        return x, torch.cat([torch.as_tensor(b[b"labels"], dtype=torch.int64) for b in batches])

    return (*read([f"data_batch_{i}" for i in range(1, 6)]), *read(["test_batch"]))


def tiny_net(num_classes=10):
    """The recipe's `tiny` model, layer for layer (its state-dict names included)."""
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(8, 16, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Sequential(nn.AdaptiveAvgPool2d(8), nn.Flatten()), nn.Linear(16 * 8 * 8, num_classes))


def cifar_recipe_by_hand(root, *, global_batch, micro_batch, epochs, lr, weight_decay, warmup, label_smoothing,
                         seed=0):
    """What `python recipes/cifar.py --model tiny --augment none` documents, written out: the model seeded
    with torch.manual_seed(seed); SGD (Nesterov momentum 0.9) with weight decay on weights but not biases;
    linear warm-up over int(warmup x steps) steps then linear decay to 0; each epoch's permutation cut into
    global batches of micro-batches; inputs scaled to [0, 1] and normalised with the CIFAR mean and std.
    Returns (final state dict, every micro-batch's training loss, test accuracy, mean test loss)."""
    train_x, train_y, test_x, test_y = read_cifar10(root)
    mean, std = torch.tensor(CIFAR_MEAN).view(-1, 1, 1), torch.tensor(CIFAR_STD).view(-1, 1, 1)
    normal = lambda x: (x.float() / 255 - mean) / std
    torch.manual_seed(seed)
    model = tiny_net()
    params = list(model.parameters())
    optimizer = torch.optim.SGD([{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
                                 {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}],
                                lr=lr, momentum=0.9, nesterov=True)
    accum, total = global_batch // micro_batch, epochs * (len(train_x) // global_batch)
    warm = max(1, int(total * warmup))
    lr_at = lambda step: lr * ((step + 1) / warm if step < warm else max(0.0, (total - step) / max(1, total - warm)))
    micro = [torch.tensor(batch[i:i + micro_batch]) for epoch in range(epochs)
             for batch in global_batches(epoch, global_batch, seed, len(train_x))
             for i in range(0, global_batch, micro_batch)]
    losses = []
    train_by_hand(model, optimizer, [(normal(train_x[i]), train_y[i]) for i in micro], accum, lr_at=lr_at,
                  label_smoothing=label_smoothing, losses=losses)
    with torch.no_grad():
        logits = model(normal(test_x))
    accuracy = (logits.argmax(1) == test_y).float().mean().item()
    test_loss = torch.nn.functional.cross_entropy(logits, test_y).item()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses, accuracy, test_loss


def optimizer_recipe_by_hand(root, *, global_batch, micro_batch, epochs, lr, weight_decay, warmup, max_norm, ema_decay,
                             seed=0):
    """`python recipes/cifar.py --model tiny --augment none --optimizer adamw --schedule cosine --clip-grad-norm N
    --ema-decay D`, written out: AdamW (betas 0.9, 0.999) with weight decay on weights but not biases; linear warm-up
    over int(warmup x steps) steps, then cosine decay to lr/10; the summed gradient of each global batch's
    micro-batches clipped to `max_norm` once per optimizer step; after each step the average of the weights moved
    by min(D, (1 + t) / (10 + t)) towards them. Returns (final state dict, average, each step's norm before
    clipping)."""
    import math

    train_x, train_y, _, _ = read_cifar10(root)
    mean, std = torch.tensor(CIFAR_MEAN).view(-1, 1, 1), torch.tensor(CIFAR_STD).view(-1, 1, 1)
    torch.manual_seed(seed)
    model = tiny_net()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.ndim > 1], "weight_decay": weight_decay},
                                   {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}], lr=lr)
    accum, total = global_batch // micro_batch, epochs * (len(train_x) // global_batch)
    warm = max(1, int(total * warmup))
    average = {name: p.detach().clone() for name, p in model.named_parameters()}
    norms = []
    for step, batch in enumerate(b for epoch in range(epochs) for b in global_batches(epoch, global_batch, seed, len(train_x))):
        for i in range(0, global_batch, micro_batch):
            index = torch.tensor(batch[i:i + micro_batch])
            x = (train_x[index].float() / 255 - mean) / std
            (torch.nn.functional.cross_entropy(model(x), train_y[index]) / accum).backward()
        progress = min(1.0, (step - warm) / max(1, total - warm))
        factor = (step + 1) / warm if step < warm else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = lr * factor
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        decay = min(ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for name, p in model.named_parameters():
                average[name].mul_(decay).add_(p, alpha=1 - decay)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, average, norms
