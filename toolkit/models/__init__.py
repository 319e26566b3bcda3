"""Models: the toolkit's own nets (`nets`: tiny, resnet9, resnet18), any torchvision classifier at any image
size (`vision`), and model weights in and out of safetensors or torch files (`weights`)."""
