"""Models: the toolkit's own nets (`nets`: tiny, resnet9, resnet18), any torchvision or timm classifier at any image
size, from local or locally cached pretrained weights, its backbone frozen on request (`vision`, `timm_models`),
and a small character-level GPT (`gpt`). Weight files in and out of safetensors or torch files
are toolkit/checkpoint/weights.py's."""
