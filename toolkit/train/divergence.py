"""Loud warnings for a run that trains to nothing while exiting 0: a schedule too short to start at the full
learning rate (said once at start), and evaluations that show divergence or a model still at chance (said
once, at the first that does, on the main process, and kept in `DivergenceWatch.warnings`, which
`TrainingRun` exposes as `run.warnings` for the summary). Warnings, not errors: the run goes on and exits 0.

Why these rules (measured on sklearn's digits as a PNG folder, recipes/images.py, resnet18 at 32 px, seed 0):
the torchvision preset (global batch 256, lr 0.1, no warm-up) gets 15 optimizer steps in 3 epochs there and
ends at chance, 0.111, its test loss 363 -> 158,772 -> 3,825; at global batch 64 (69 steps, lr 0.025) it
reaches 0.865. That good run's first evaluation is also at chance (0.111) with a test loss of 75, 33x chance
level: a BatchNorm net early in a short run is evaluated with running statistics that lag its weights. So
a loss far above chance, or an accuracy at chance, is judged from the second evaluation on (or at the last,
when there is only one); a loss growing tenfold from one evaluation to the next is judged wherever it is seen.

    >>> watch = DivergenceWatch(total_steps=15, lr=0.1, global_batch=256, warmup=0.0, classes=10)
    >>> watch.check({"accuracy": 0.111, "loss": 363.4, "count": 297})     # the first evaluation: not judged
    >>> print(watch.check({"accuracy": 0.111, "loss": 158772.0, "count": 297}))   # doctest: +ELLIPSIS
    [toolkit] warning: test loss 1.59e+05 is 437x the previous evaluation's 363 and 68954x chance level ...
    >>> watch.check({"accuracy": 0.111, "loss": 3825.0, "count": 297}, final=True) is None   # said once a run
    True
    >>> len(watch.warnings)   # with the start-time line: 15 steps at full lr
    2
"""

from __future__ import annotations

import math
from collections.abc import Callable

from toolkit.train.optim import warmup_linear_decay

GROWTH = 10.0  # an order of magnitude: a test loss this many times the previous one (or chance level) diverged
CHANCE_SIGMAS = 3.0  # accuracy within this many binomial standard errors above 1/classes counts as chance
MIN_STEPS_WITHOUT_WARMUP = 300  # a run shorter than this that starts at its full lr is warned about at start
SUGGESTED_WARMUP = 0.1


def starts_at_full_lr(total_steps: int, warmup: float) -> bool:
    """Whether the run's first optimizer step already runs at its full lr, by the schedule itself (a warm-up
    fraction that rounds to one step is none).

    >>> starts_at_full_lr(15, 0.0), starts_at_full_lr(69, 0.1), starts_at_full_lr(3, 0.2)
    (True, False, True)
    """
    return warmup_linear_decay(total_steps, warmup)(0) >= 1.0


def suggestion(total_steps: int, global_batch: int, warmup: float) -> str:
    """The flags to try: a quarter of the global batch (four times the steps; the lr scales down with it
    unless --lr is given) and a warm-up, or more epochs."""
    smaller = f" {global_batch // 4}" if global_batch >= 32 else " (smaller)"
    return (f"try --global-batch-size{smaller} (more, smaller steps) with --warmup {max(warmup, SUGGESTED_WARMUP):g}"
            f", or more --epochs")


def schedule_warning(total_steps: int, lr: float, global_batch: int, warmup: float) -> str | None:
    """One line when the run starts at its full learning rate (no warm-up, or a warm-up fraction that rounds to
    under 2 of its steps) and has fewer than MIN_STEPS_WITHOUT_WARMUP optimizer steps: a long run (torchvision's
    90-epoch recipe takes ~450,000 steps) absorbs the early spike of a fresh net at full lr that warm-up exists
    to avoid (Goyal et al. 2017, section 2.2); a short one can end diverged. None otherwise.

    >>> print(schedule_warning(15, 0.1, 256, 0.0))   # doctest: +ELLIPSIS
    [toolkit] warning: 15 optimizer steps at lr 0.1 (global batch 256) with no warm-up: too few to start at the ...
    >>> schedule_warning(234, 0.04, 64, 0.2) is None and schedule_warning(1260, 0.1, 256, 0.0) is None
    True
    """
    if total_steps >= MIN_STEPS_WITHOUT_WARMUP or not starts_at_full_lr(total_steps, warmup):
        return None
    warm = "no warm-up" if warmup == 0 else f"a warm-up of {warmup:g} x {total_steps} steps (under 2 steps)"
    return (f"[toolkit] warning: {total_steps} optimizer steps at lr {lr:g} (global batch {global_batch}) with {warm}: "
            f"too few to start at the full lr, the run may diverge; {suggestion(total_steps, global_batch, warmup)}")


def chance_accuracy_bound(classes: int | None, count: int) -> float | None:
    """The highest top-1 accuracy over `count` samples that is still chance for `classes` balanced classes:
    1/classes plus CHANCE_SIGMAS binomial standard errors; None when there are too few samples (or classes)
    to tell chance from learning (the margin would cover half the way from chance to perfect).

    >>> round(chance_accuracy_bound(10, 297), 3), chance_accuracy_bound(2, 10), chance_accuracy_bound(None, 297)
    (0.152, None, None)
    """
    if not classes or classes < 2 or count < 1:
        return None
    chance = 1 / classes
    margin = CHANCE_SIGMAS * math.sqrt(chance * (1 - chance) / count)
    return chance + margin if margin < (1 - chance) / 2 else None


class DivergenceWatch:
    """Watches a run's schedule and evaluations; `TrainingRun` makes one as `run.divergence`, saying its lines
    on the main process. `started(classes)` says `schedule_warning`'s line, if any; `check(metrics)` after each
    evaluation (`evaluate`'s dict: accuracy, loss, count) says one warning line the first time any symptom shows
    and returns it, else None. `warnings` keeps every line: the start-time one from construction (said or not),
    then each evaluation's. `classes` (chance level) may also be passed to `check`.

    Symptoms: the test loss is not finite; it is GROWTH x the previous evaluation's (and above chance level,
    ln classes, so a tiny loss creeping up is not one); from the second evaluation on (or at the final one):
    it is GROWTH x chance level, or the accuracy is at chance (`chance_accuracy_bound`). The likely cause
    named: see `likely_cause`.
    """

    def __init__(self, total_steps: int, lr: float, global_batch: int, warmup: float, classes: int | None = None,
                 say: Callable[[str], None] | None = None, check_schedule: bool = True):
        self.total_steps, self.lr, self.global_batch, self.warmup = total_steps, lr, global_batch, warmup or 0.0
        self.classes, self.say = classes, say or (lambda line: None)
        # check_schedule=False: a run cut short on purpose (--max-steps, a smoke test) is not warned at start;
        # its evaluations still are.
        self.start_warning = schedule_warning(total_steps, lr, global_batch, self.warmup) if check_schedule else None
        self.warnings: list[str] = [self.start_warning] if self.start_warning else []
        self._said = False  # one line a run: every symptom names the same likely cause
        self._previous_loss: float | None = None
        self._evaluations = 0

    def started(self, classes: int | None = None) -> str | None:
        """At the start of training (after the recipe's start line): say `start_warning`, if any; `classes` (the
        model's outputs) sets chance level for the evaluations."""
        self.classes = classes or self.classes
        if self.start_warning:
            self.say(self.start_warning)
        return self.start_warning

    def symptoms(self, metrics: dict, final: bool = False, classes: int | None = None) -> dict[str, str]:
        """{kind: words} of what this evaluation shows, reported or not (the loss kinds' words follow "test loss X
        is"); advances the watch by one evaluation."""
        classes = classes or self.classes
        loss, accuracy, previous = metrics["loss"], metrics["accuracy"], self._previous_loss
        chance_loss = math.log(classes) if classes and classes >= 2 else None
        judged = self._evaluations >= 1 or final  # see the module docstring: not the first evaluation alone
        self._evaluations, self._previous_loss = self._evaluations + 1, loss
        found = {}
        if not math.isfinite(loss):
            found["loss-nonfinite"] = "not finite"
            return found
        if previous is not None and loss > GROWTH * previous and (chance_loss is None or loss > chance_loss):
            found["loss-growth"] = f"{loss / previous:.0f}x the previous evaluation's {previous:.3g}"
        if judged and chance_loss is not None and loss > GROWTH * chance_loss:
            found["loss-above-chance"] = f"{loss / chance_loss:.0f}x chance level (ln {classes} = {chance_loss:.2f})"
        bound = chance_accuracy_bound(classes, metrics.get("count", 0))
        if judged and bound is not None and accuracy <= bound:
            found["accuracy-at-chance"] = (f"test accuracy {accuracy:.3f} is at chance (1/{classes} = "
                                           f"{1 / classes:.3f}; at most {bound:.3f} over {metrics['count']} samples)")
        return found

    def check(self, metrics: dict, final: bool = False, classes: int | None = None) -> str | None:
        """Say one line naming this evaluation's symptoms and their likely cause, the first time any shows, and
        return it; None otherwise (nothing shows, or the run's line was said)."""
        new = self.symptoms(metrics, final, classes)
        if not new or self._said:
            return None
        self._said = True
        loss = [words for kind, words in new.items() if kind.startswith("loss-")]
        said = ([f"test loss {metrics['loss']:.3g} is {' and '.join(loss)}"] if loss else []) + [
            words for kind, words in new.items() if not kind.startswith("loss-")]
        line = f"[toolkit] warning: {'; '.join(said)}: the model is not learning; {self.likely_cause(bool(loss))}"
        self.warnings.append(line)
        self.say(line)
        return line

    def likely_cause(self, diverged: bool = True) -> str:
        """Why, and what to try: a diverged loss on a run that starts at full lr had too few steps for its lr and
        global batch (else the lr is too high); an accuracy at chance with a loss that did not blow up, too few
        steps for this model (measured: torchvision's MobileNetV3, whose BatchNorm averages its statistics at
        momentum 0.01, trains to 0.91-0.96 in training mode in 69-279 steps at 32 px yet evaluates at chance)."""
        fix = suggestion(self.total_steps, self.global_batch, self.warmup)
        if not diverged:
            return (f"likely cause: too few optimizer steps ({self.total_steps}) for this model at lr {self.lr:g} and "
                    f"global batch {self.global_batch}: its weights, or the running statistics its BatchNorm layers "
                    f"evaluate with, are still near their start; {fix}")
        if self.start_warning:
            warm = "no warm-up" if self.warmup == 0 else f"warm-up {self.warmup:g}"
            return (f"likely cause: too few optimizer steps ({self.total_steps}) for lr {self.lr:g} at global batch "
                    f"{self.global_batch} with {warm}; {fix}")
        return (f"likely cause: lr {self.lr:g} too high for global batch {self.global_batch}; try a lower --lr, or "
                f"a smaller --global-batch-size with a longer --warmup")
