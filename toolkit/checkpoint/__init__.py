"""The checkpoint format, in one place: what every engine's save_state / load_state, a real
`accelerate.Accelerator`, the functional API, `TrainingRun` and `toolkit checkpoint consolidate` write and read.

- `state`: the one writer and reader of a save_state folder: an engine hands over state dicts and its registries
  and takes them back; code without an engine reads a model's weights or registered objects through it.
- `folder`: the folder itself (Accelerate's save_state layout plus state.json and manifest.json), built hidden and
  published atomically (`building`), `step-N` names, the `latest` and `best` pointers, pruning, verification.
- `files`: the files besides the weights (schedulers, GradScaler, each rank's RNG streams, registered objects,
  state.json) and reading them without unpickling code.
- `full`, `sharded`: the weights and optimizer state, whole (safetensors and torch's optimizer layout) or as each
  rank's shards (torch.distributed.checkpoint).
- `weights`: weight files that move between engines (every wrapper stripped).
- `functional`, `functional_sharded`: save_checkpoint / load_checkpoint for code that holds no engine.
- `consolidate`: a sharded folder to a full one.

Nothing here imports an engine (tests/test_layers.py), and nothing outside calls the functions that create,
publish, prune or read a folder's files.
"""
