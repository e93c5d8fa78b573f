"""What a step costs, learned from the engine's own steps, so the scheduler can bound step time.

A step's time is close to linear in four things: a fixed part (launching the forward, the
scheduler, output handling), its tokens (every weight multiplies every token), its requests
(a sampled row each: the lm_head and the sampler) and its attention pairs (each new token
attends to every earlier token of its request). The model keeps the last WINDOW measured steps
and refits non-negative weights every REFIT_EVERY steps; until MIN_OBSERVATIONS steps are seen it
is not ready and the scheduler uses only its token budget.

StepBudget turns max_step_ms into what the next step may be predicted to take.

Plain Python (four features: a 4x4 solve), so that the engine core imports no numpy or torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from minivllm.core.outputs import STEP_COST_ERROR_BUCKETS, Histogram

NUM_FEATURES = 4


@dataclass
class StepShape:
    num_tokens: int = 0
    num_reqs: int = 0
    num_attention_pairs: int = 0

    def add(self, num_computed: int, num_new: int, sign: int = 1) -> None:
        """A request computing `num_new` tokens after `num_computed` (sign -1: take it back)."""
        self.num_tokens += sign * num_new
        self.num_reqs += sign
        # Token i of the chunk attends to num_computed + i + 1 keys.
        self.num_attention_pairs += sign * (num_new * num_computed + num_new * (num_new + 1) // 2)

    def with_chunk(self, num_computed: int, num_new: int) -> StepShape:
        shape = StepShape(self.num_tokens, self.num_reqs, self.num_attention_pairs)
        shape.add(num_computed, num_new)
        return shape

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.num_tokens), float(self.num_reqs), float(self.num_attention_pairs))


class StepCostModel:
    WINDOW = 512
    REFIT_EVERY = 16
    MIN_OBSERVATIONS = 16

    def __init__(self) -> None:
        self._features: deque[tuple[float, ...]] = deque(maxlen=self.WINDOW)
        self._seconds: deque[float] = deque(maxlen=self.WINDOW)
        self._since_fit = 0
        self.weights: list[float] | None = None
        # |measured / predicted - 1| of every step predicted before it ran: what a budget can trust.
        self.error = Histogram(STEP_COST_ERROR_BUCKETS)

    @property
    def ready(self) -> bool:
        return self.weights is not None

    def observe(self, shape: StepShape, seconds: float) -> float | None:
        """Learn from a measured step; returns what the model predicted for it (None: not
        ready yet, or an empty step)."""
        if shape.num_tokens == 0 or seconds <= 0:
            return None
        predicted = max(self.predict(shape), 1e-9) if self.ready else None
        if predicted is not None:
            self.error.observe(abs(seconds / predicted - 1))
        self._features.append(shape.features())
        self._seconds.append(seconds)
        self._since_fit += 1
        if len(self._seconds) >= self.MIN_OBSERVATIONS and (self.weights is None or self._since_fit >= self.REFIT_EVERY):
            self._fit()
        return predicted

    def predict(self, shape: StepShape) -> float:
        """Seconds; only when ready."""
        assert self.weights is not None
        return sum(w * f for w, f in zip(self.weights, shape.features(), strict=True))

    def _fit(self) -> None:
        """Least squares of the relative error (each step weighs 1/its time: a decode step of
        10 ms matters as much as a prefill of 1 s), every weight >= 0: a feature that would get
        a negative weight is left out and the rest refitted (four features, at most four
        passes). Columns are scaled to their largest value first: attention pairs run to
        millions, the constant is 1."""
        xs, ys = list(self._features), list(self._seconds)
        scale = [max(max(abs(x[j]) for x in xs), 1e-12) for j in range(NUM_FEATURES)]
        # Divided by its time, each step's target is 1.
        rows = [[x[j] / scale[j] / y for j in range(NUM_FEATURES)] for x, y in zip(xs, ys, strict=True)]
        active = list(range(NUM_FEATURES))
        weights = [0.0] * NUM_FEATURES
        while active:
            gram = [[sum(r[i] * r[j] for r in rows) for j in active] for i in active]
            rhs = [sum(r[i] for r in rows) for i in active]
            solution = _solve(gram, rhs)
            if solution is not None and all(w >= 0 for w in solution):
                for i, w in zip(active, solution, strict=True):
                    weights[i] = w / scale[i]
                break
            if solution is None:  # a feature that never varied: drop the last one
                active.pop()
            else:
                active = [i for i, w in zip(active, solution, strict=True) if w >= 0]
        self.weights = weights
        self._since_fit = 0


class StepBudget:
    """What the next step may be predicted to take under max_step_ms.

    Two bounds. No step longer than max_step_ms: a stream's longest gap between tokens. And over
    any WINDOW consecutive steps at most SUSTAINED_FRACTION of it on average: under a sustained
    load of prompts a stream still gets a token every 0.6 x max_step_ms, while a prompt that
    arrives after a few quick decode steps may use the whole budget at once (its first token
    comes sooner). A linear fit is right on average, so half the steps planned at the budget
    would overrun it: the allowance is divided by the 90th percentile of measured / predicted
    over the last MARGIN_WINDOW steps planned near the budget, so nine in ten end within it.
    """

    WINDOW = 4
    SUSTAINED_FRACTION = 0.6
    MARGIN_WINDOW = 64
    MARGIN_QUANTILE = 0.9

    def __init__(self, max_step_s: float) -> None:
        self.max_step_s = max_step_s
        self._recent: deque[float] = deque(maxlen=self.WINDOW - 1)
        self._overruns: deque[float] = deque(maxlen=self.MARGIN_WINDOW)
        self.margin = 1.0

    def observe(self, seconds: float, predicted: float | None) -> None:
        self._recent.append(seconds)
        if predicted is not None and predicted >= self.max_step_s / 2:
            self._overruns.append(seconds / predicted)
            if len(self._overruns) >= self.MARGIN_WINDOW // 8:
                ratios = sorted(self._overruns)
                self.margin = max(1.0, ratios[int(self.MARGIN_QUANTILE * (len(ratios) - 1))])

    def allowance(self) -> float:
        """Predicted seconds the next step may take (0 or less: none left beyond the decodes)."""
        sustained = self.WINDOW * self.SUSTAINED_FRACTION * self.max_step_s - sum(self._recent)
        return min(self.max_step_s, sustained) / self.margin


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting, with a small ridge (the columns are scaled to
    at most 1, so 1e-9 only matters for a singular system); None if still singular."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b, strict=True)]
    for i in range(n):
        m[i][i] += 1e-9
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (m[i][n] - sum(m[i][c] * x[c] for c in range(i + 1, n))) / m[i][i]
    return x
