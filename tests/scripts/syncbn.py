"""--sync-bn on CPU ranks: PyTorch refuses SyncBatchNorm there, so the toolkit says so once and averages
BatchNorm running statistics across ranks instead. Writes each rank's statistics to OUT-rankR.pt."""
import sys

import torch

import toolkit
from toolkit.train.common import average_batchnorm_stats, batchnorm_layers, convert_sync_batchnorm

accelerator = toolkit.build_accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.LazyLinear(2))
model(torch.zeros(1, 3, 8, 8))  # materialise the lazy layer identically on every rank
model, fallback = convert_sync_batchnorm(model, accelerator)
assert fallback and not any(isinstance(m, torch.nn.SyncBatchNorm) for m in model.modules())
model = accelerator.prepare(model)
torch.manual_seed(100 + accelerator.process_index)  # each rank sees different data
for _ in range(3):
    model(torch.randn(8, 3, 8, 8) * (1 + accelerator.process_index)).sum().backward()
layer = batchnorm_layers(accelerator.unwrap_model(model))[0]
before_mean, before_var = layer.running_mean.clone(), layer.running_var.clone()
average_batchnorm_stats(model, accelerator)
after = batchnorm_layers(accelerator.unwrap_model(model))[0]
torch.save({"before_mean": before_mean, "before_var": before_var, "mean": after.running_mean, "var": after.running_var},
           f"{sys.argv[1]}-rank{accelerator.process_index}.pt")
accelerator.end_training()
