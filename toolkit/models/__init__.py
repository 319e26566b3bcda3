"""Models: the toolkit's own nets (`nets`: tiny, resnet9, resnet18), any torchvision classifier at any image
size (`vision`), and a small character-level GPT (`gpt`). Weight files in and out of safetensors or torch files
are toolkit/engines/weights.py's."""
