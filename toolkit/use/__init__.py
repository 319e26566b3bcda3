"""Using a trained model: `toolkit predict` (top-k classes of image files) and `toolkit export` (ONNX,
TorchScript or safetensors, each checked against PyTorch), both from any recipe checkpoint (full or sharded,
saved by any engine) loaded by toolkit/use/model.py. See docs/predict-and-export.md."""
