"""Exits at once without stepping an optimizer: `toolkit parity` must say it saw no step."""
print("nothing to train")
