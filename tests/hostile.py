"""What a crafted pickle does: call any function on load. Unpickling a `CreatesFileOnLoad` creates its
target file, so a test sees whether a loader ran anything (CIFAR batches, checkpoints, DCP metadata)."""


class CreatesFileOnLoad:
    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))
