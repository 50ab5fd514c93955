"""The dense fallback of buckets whose compression's factors keep failing from finite
gradients (a factorization failed, or a factor came out non-finite; issues 50, 56): sent
dense for a bounded number of iterations, then compressed again, every turn named.

Pure bookkeeping on the host, fed at the log interval with the failure counts the DP patch
(:mod:`megatron_edgc.patches.ddp`) reduced over the DP group; the same on every member.
"""

from __future__ import annotations

from dataclasses import dataclass

#: A bucket whose factors failed this many times, with no read of the flags free of
#: failures between, is sent dense (an all-reduce of the whole bucket, as megatron-core's)
#: for ``--edgc-fallback-iters`` iterations, then compressed again.
FALLBACK_AFTER_FAILURES = 2
#: The fallback's interval doubles while failures repeat, up to this many times the first.
FALLBACK_MAX_GROWTH = 64


@dataclass
class DenseFallback:
    """A bucket sent dense because its factors failed: dense for iterations before
    ``until`` (0-based), then compressed again; ``interval`` is how long it was sent dense
    (the next fallback's is twice it, while failures repeat)."""

    until: int
    interval: int


class FallbackPolicy:
    """Which buckets the fallback sends dense, by bucket key (``iters``: the first
    interval, ``--edgc-fallback-iters``)."""

    def __init__(self, keys, iters: int):
        self.keys = list(keys)
        self.iters = iters
        self.fallbacks: dict[str, DenseFallback] = {}   # buckets whose factors failed
        self.failures: dict[str, int] = {}              # bucket key -> failures so far

    def dense_at(self, iteration: int, events: list) -> frozenset:
        """The buckets sent dense at ``iteration`` (0-based); a bucket whose interval ends
        there is compressed again, named in ``events``."""
        for key, f in self.fallbacks.items():
            if iteration == f.until:
                events.append(f"{key}: compressed again from iteration {iteration + 1}, "
                              f"after {f.interval} iterations sent dense (its factors had "
                              f"failed)")
        return frozenset(k for k, f in self.fallbacks.items() if iteration < f.until)

    def observe(self, counts: dict, iteration: int, events: list) -> None:
        """The factor failures per bucket of the steps read up to ``iteration`` (1-based).
        A bucket that reaches :data:`FALLBACK_AFTER_FAILURES` without a read free of
        failures between them is sent dense from the next iteration for ``iters``
        iterations, then compressed again; while failures repeat the interval doubles (up
        to :data:`FALLBACK_MAX_GROWTH` times), and it resets once the bucket has compressed
        as long without one. Each turn is named in ``events``."""
        for key, count in counts.items():
            fallback = self.fallbacks.get(key)
            if not count:   # a read without a failure: the bucket recovered
                self.failures.pop(key, None)
                if fallback is not None and iteration >= fallback.until + fallback.interval:
                    del self.fallbacks[key]   # compressed an interval long: reset
                continue
            total = self.failures[key] = self.failures.get(key, 0) + int(count)
            if total < FALLBACK_AFTER_FAILURES or (fallback and iteration < fallback.until):
                continue
            interval = self.iters if fallback is None else \
                min(2 * fallback.interval, FALLBACK_MAX_GROWTH * self.iters)
            self.fallbacks[key] = DenseFallback(iteration + interval, interval)
            self.failures.pop(key)
            events.append(
                f"{key}: compression's factors failed from finite gradients {total} times "
                f"by iteration {iteration}: sent dense (an all-reduce of the bucket, as "
                f"megatron-core's) for iterations {iteration + 1}-{iteration + interval}, "
                f"then compressed again")

    def state_dict(self) -> dict:
        return {"fallbacks": {k: [f.until, f.interval] for k, f in self.fallbacks.items()},
                "factor_failures": dict(self.failures)}

    def load_state_dict(self, state: dict) -> None:
        fallbacks = {k: DenseFallback(*v) for k, v in state.get("fallbacks", {}).items()}
        # a checkpoint of before the fallback came back: its buckets dense "for good" are
        # tried again at once, and a new failure sends them dense for twice the interval
        fallbacks.update({k: DenseFallback(0, self.iters)
                          for k in state.get("fallen_back", ()) if k not in fallbacks})
        self.fallbacks = {k: f for k, f in fallbacks.items() if k in self.keys}
        self.failures = {k: v for k, v in state.get("factor_failures", {}).items()
                         if k in self.keys}
