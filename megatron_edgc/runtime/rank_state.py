"""Per-rank state of the EDGC extensions, for checkpoints: a registry both front-ends save
and restore (this project's trainer with its own files, the Megatron-LM plug-in with a
sidecar file per rank).

Extensions (the gradient compressor, the PP communicator, the rank controller) register a
``state_dict``/``load_state_dict`` pair under a name. After a DP-size change only those
that declared themselves DP-invariant (the rank controller: identical on every replica)
are restored; the others (error-feedback residuals, warm starts: one per replica,
nothing to map them to) start fresh.
"""

from __future__ import annotations

from typing import Callable

# name -> (state_dict fn, load_state_dict fn); per-rank state of extensions.
_RANK_STATE: dict[str, tuple[Callable[[], dict], Callable[[dict], None]]] = {}
_DP_INVARIANT: set = set()  # extensions whose state is the same on every DP replica


def register_rank_state(name: str, save: Callable[[], dict], load: Callable[[dict], None],
                        dp_invariant: bool = False):
    _RANK_STATE[name] = (save, load)
    (_DP_INVARIANT.add if dp_invariant else _DP_INVARIANT.discard)(name)


def unregister_rank_state(name: str) -> None:
    _RANK_STATE.pop(name, None)
    _DP_INVARIANT.discard(name)


def collect_rank_state() -> dict:
    """Every registered extension's state on this rank: ``{name: state}``."""
    return {name: save() for name, (save, _) in _RANK_STATE.items()}


def restore_rank_state(saved: dict, dp_changed: bool) -> list:
    """Load ``saved`` (from :func:`collect_rank_state`) into the registered extensions.
    After a DP-size change only the DP-invariant ones are loaded; returns the names of
    those left fresh."""
    reset = []
    for name, (_, load) in _RANK_STATE.items():
        if name not in saved:
            continue
        if dp_changed and name not in _DP_INVARIANT:
            reset.append(name)
            continue
        load(saved[name])
    return reset
