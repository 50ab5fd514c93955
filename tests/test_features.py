"""The megatron-core feature checks of the patches (one process, no process group)."""

import types

import pytest
from megatron.core import package_info
from megatron.core.distributed import param_and_grad_buffer
from megatron.core.pipeline_parallel import p2p_communication, schedules

from megatron_edgc.patches import ddp, features, megatron_buckets, p2p
from megatron_edgc.patches.cpu import UnsupportedMegatronVersion, check_megatron_version


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(features, "_warned", set())


def one_line_error(**kwargs) -> str:
    with pytest.raises(UnsupportedMegatronVersion) as info:
        check_megatron_version(**kwargs)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"megatron-core {features.megatron_core_version()} lacks")
    assert ", ".join(features.SUPPORTED_MEGATRON_CORE_VERSIONS) in msg
    return msg


def test_installed_version_is_supported_complete_and_silent(capsys):
    version = features.megatron_core_version()
    assert version in features.SUPPORTED_MEGATRON_CORE_VERSIONS
    assert features.missing_features() == []
    assert check_megatron_version() == version
    assert capsys.readouterr().err == ""


def test_unsupported_but_complete_version_warns_once(monkeypatch, capsys):
    monkeypatch.setattr(package_info, "__version__", "0.99.0")
    assert check_megatron_version() == "0.99.0"
    assert check_megatron_version() == "0.99.0"
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: megatron-core 0.99.0 is untested")
    assert "--allow-untested-megatron" in lines[0]
    features._warned.clear()
    assert check_megatron_version(allow_untested=True) == "0.99.0"   # silenced
    assert capsys.readouterr().err == ""


def test_missing_method_is_one_line_naming_it_whatever_the_version(monkeypatch):
    monkeypatch.delattr(param_and_grad_buffer._ParamAndGradBucketGroup, "finish_grad_sync")
    msg = one_line_error()
    assert "_ParamAndGradBucketGroup.finish_grad_sync (the ddp patch)" in msg
    assert one_line_error(allow_untested=True) == msg               # no flag forces it
    with pytest.raises(UnsupportedMegatronVersion, match="finish_grad_sync"):
        features.require("ddp")
    features.require("p2p", "timing", "cpu")                         # theirs are all there


def test_missing_parameter_is_named(monkeypatch):
    def batched(*, tensor_send_prev, tensor_recv_prev, tensor_send_next, tensor_recv_next,
                group, next_pipeline_rank):
        return []

    monkeypatch.setattr(p2p_communication, "_batched_p2p_ops", batched)
    msg = one_line_error()
    assert "p2p_communication._batched_p2p_ops(..., prev_pipeline_rank=) (the p2p patch)" in msg


def test_missing_rng_tracker_and_instance_attribute_are_named(monkeypatch):
    from megatron.core.tensor_parallel import random as mp_random

    monkeypatch.delattr(mp_random, "_EXPERT_PARALLEL_RNG_TRACKER_NAME")
    assert "random._EXPERT_PARALLEL_RNG_TRACKER_NAME (the cpu patch)" in one_line_error()
    # The DP patch also checks the live bucket groups it is handed.
    with pytest.raises(UnsupportedMegatronVersion, match=r"_ParamAndGradBucketGroup\."
                                                         r"grad_reduce_handle \(the ddp patch\)"):
        megatron_buckets.require_attributes(types.SimpleNamespace(buckets=[], ddp_config=None),
                                            megatron_buckets.GROUP_ATTRIBUTES,
                                            "_ParamAndGradBucketGroup")


def test_a_module_that_fails_to_import_is_named_with_the_reason():
    with pytest.raises(features._Missing, match=r"megatron\.core\.no_such_module \(import "
                                                r"failed: No module named"):
        features.resolve("megatron.core.no_such_module")


def test_schedules_without_any_communicator_seam_and_untimed_backward(monkeypatch):
    def opaque(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
               micro_batch_size, decoder_seq_length=None, forward_only=False):
        return []

    monkeypatch.setattr(schedules, "forward_backward_pipelining_without_interleaving", opaque)
    msg = one_line_error()
    # all three forms are named: 0.15+ (pg_collection), 0.14 (grad_finalize_pgs), 0.13
    assert "without_interleaving(..., p2p_communicator=)" in msg
    assert "calling p2p_communication by name (the p2p patch)" in msg
    assert "without_interleaving calling backward_step by name (the timing patch)" in msg


def test_form_probes():
    assert features.grad_sync_takes_force_all_reduce() == (features.megatron_core_version() >= "0.16")

    def new(*, p2p_communicator=None, pg_collection=None):
        pass

    def v014(*, p2p_communicator=None, grad_finalize_pgs=None):
        pass

    def v013(*, forward_only=False):
        pass

    assert [features.schedule_form(f) for f in (new, v014, v013)] == \
        ["pg_collection", "grad_finalize_pgs", "module"]


def test_module_level_schedule_routes_transfers_to_the_communicator(monkeypatch):
    """0.13.x's form: the adapted schedule drops the arguments it does not take and sends
    its module-level transfers through the communicator for the call only."""
    sent = []

    class Communicator:
        def _communicate(self, **kwargs):
            sent.append(kwargs)
            return None, None, None

    def original(**kwargs):  # 0.13.x's module-level function (0.14+ has none)
        raise AssertionError("not routed")

    monkeypatch.setattr(p2p_communication, "_communicate", original, raising=False)

    def schedule(*, forward_only=False):
        p2p_communication._communicate(tensor_send_next=None, tensor_send_prev="g",
                                       recv_prev=False, recv_next=False, tensor_shape=None,
                                       config="cfg", wait_on_reqs=True)
        return "losses"

    adapted = p2p._adapt_schedule(schedule)
    assert adapted(forward_only=True, p2p_communicator=Communicator(),
                   pg_collection=object()) == "losses"
    assert sent == [dict(tensor_send_next=None, tensor_send_prev="g", recv_prev=False,
                         recv_next=False, tensor_shape=None, wait_on_reqs=True)]
    assert p2p_communication._communicate is original


def test_cli_prints_the_missing_feature_as_one_error_line(monkeypatch, capsys,
                                                          small_model_argv):
    from megatron_edgc.training import pretrain

    monkeypatch.delattr(schedules, "backward_step")
    assert pretrain.main(small_model_argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: megatron-core ")
    assert "schedules.backward_step (the timing patch)" in err[0]


def test_instances_overlap_bug_is_refused_on_gpu_only():
    """Megatron-LM issue #3670: megatron-core before 0.17 syncs the partial distributed
    optimizer's communication stream with the default stream: refused on a GPU with
    --overlap-grad-reduce, naming the flag's combination; fine without overlap, with one
    instance, or on CPU (one null stream)."""
    from megatron_edgc.patches.features import (instances_overlap_waits_on_current_stream,
                                                megatron_core_version,
                                                refuse_instances_overlap)

    fixed = instances_overlap_waits_on_current_stream()
    assert fixed == (tuple(int(x) for x in megatron_core_version().split(".")[:2]) >= (0, 17))
    assert refuse_instances_overlap(2, False, True) is None
    assert refuse_instances_overlap(1, True, True) is None
    assert refuse_instances_overlap(2, True, False) is None
    why = refuse_instances_overlap(2, True, True)
    if fixed:
        assert why is None
    else:
        assert "issue #3670" in why and "drop --overlap-grad-reduce" in why
