"""Training: the loop both recipes share (`loop`), the global batch split over processes (`batching`),
per-model hyperparameters (`presets`), evaluation, schedule and step helpers (`common`), where a run is and
how it resumes (`run_state`), checkpoints (`checkpoint`) and metrics files (`records`)."""
