"""The plug-in never silently off (issue 92), in one process: the first-step hook on
megatron-core's classes, the line a job stops with for each way EDGC misses it, and the
summary's words. The jobs themselves: ``tests/test_megatron_lm.py``
(``test_a_loop_the_plug_in_does_not_reach_stops_before_its_first_step``)."""

import sys

import pytest

from megatron_edgc.config import RunConfig
from megatron_edgc.megatron_lm import loop_check
from megatron_edgc.megatron_lm.seams import ran_words
from megatron_edgc.megatron_lm.state import state
from megatron_edgc.patches import first_step

WHERE = "its first gradient sync (megatron-core's DistributedDataParallel.finish_grad_sync)"


class Stop(Exception):
    pass


def test_the_first_sync_or_step_calls_the_check_once_then_the_classes_are_restored():
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    originals = {c: c.__dict__[n] for c, n in [(DistributedDataParallel, "finish_grad_sync"),
                                               (ChainedOptimizer, "step"),
                                               (FP32Optimizer, "step")]}
    seen = []

    def check(where):
        seen.append(where)
        raise Stop

    first_step.watch(check)
    try:
        assert first_step.armed()
        assert all(c.__dict__[n] is not o for (c, o), n in
                   zip(originals.items(), ["finish_grad_sync", "step", "step"]))
        with pytest.raises(Stop):   # before the original runs (it would fail on None)
            ChainedOptimizer.step(None)
        assert seen == ["its first optimizer step (megatron-core's ChainedOptimizer.step)"]
        assert not first_step.armed()   # disarmed: later calls go straight through
        with pytest.raises(AttributeError):
            DistributedDataParallel.finish_grad_sync(None)
        assert len(seen) == 1
        first_step.watch(check)         # armed anew, the wrappers kept
        with pytest.raises(Stop):
            DistributedDataParallel.finish_grad_sync(None)
        assert seen[1] == WHERE
    finally:
        first_step.unwatch()
    assert not first_step.armed()
    assert all(c.__dict__[n] is o for (c, o), n in
               zip(originals.items(), ["finish_grad_sync", "step", "step"]))


@pytest.fixture
def plugin_state():
    saved = dict(vars(state))
    yield state
    vars(state).clear()
    vars(state).update(saved)


def _config(mode="edgc", pp="off") -> RunConfig:
    cfg = RunConfig()
    cfg.edgc.mode, cfg.edgc.pp_compression = mode, pp
    return cfg


def test_inside_megatron_lms_train_step_a_missed_setup_is_named(plugin_state):
    plugin_state.stepping = True
    plugin_state.cfg, plugin_state.runtime = None, None
    line = loop_check.message(WHERE)
    assert line.startswith("error: EDGC never engaged: megatron_edgc.megatron_lm.enable() was "
                           f"called, and the job reached {WHERE} inside Megatron-LM's "
                           "train_step, but Megatron-LM's validate_args ran before enable()")
    plugin_state.cfg = _config()
    line = loop_check.message(WHERE)
    assert "setup_model_and_optimizer did not run through megatron.training.training" in line
    assert line.endswith("as it stands the job would train dense")
    plugin_state.runtime = object()
    assert loop_check.message(WHERE) is None                  # EDGC engages
    plugin_state.cfg, plugin_state.runtime = _config("off"), None
    assert loop_check.message(WHERE) is None                  # off by the user's flags


#: A loop in a module named as Megatron-Bridge's, which reaches the check.
BRIDGE_LOOP = """
def train_step(message, where):
    return message(where)
"""


def test_the_loop_is_named_and_megatron_bridge_where_it_can_tell(plugin_state, monkeypatch):
    plugin_state.stepping = False
    line = loop_check.message(WHERE)
    name = f"{__name__}.test_the_loop_is_named_and_megatron_bridge_where_it_can_tell"
    assert f"reached {WHERE} in {name} at {__file__}:" in line, line
    assert "a loop the plug-in does not reach (it wraps Megatron-LM's " \
           "megatron.training.training.train_step): the job would train dense" in line
    assert "Megatron-Bridge" not in line

    monkeypatch.setitem(sys.modules, "megatron.bridge", type(sys)("megatron.bridge"))
    line = loop_check.message(WHERE)
    assert f"in {name} at" in line                            # not called Bridge's loop
    assert "; Megatron-Bridge is imported: Megatron-Bridge trains and saves through its " \
           "own, and this package has no Megatron-Bridge adapter: " \
           f"{loop_check.DOCS})" in line, line

    namespace = {"__name__": "megatron.bridge.training.train"}
    exec(compile(BRIDGE_LOOP, "/bridge/training/train.py", "exec"), namespace)
    line = namespace["train_step"](loop_check.message, WHERE)
    assert f"reached {WHERE} in Megatron-Bridge's loop, megatron.bridge.training.train." \
           f"train_step at /bridge/training/train.py:3, which the plug-in does not reach" \
           in line, line


def test_the_summary_says_whether_edgc_ran(plugin_state):
    plugin_state.cfg = _config("edgc", "static")
    assert ran_words(object()) == "EDGC ran (DP edgc, PP static)"
    plugin_state.cfg = _config("off", "off")
    assert ran_words(None) == "EDGC did not run (--edgc-mode off, --edgc-pp-compression off: " \
                              "dense)"
