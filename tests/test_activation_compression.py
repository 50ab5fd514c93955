"""PP activation-gradient compression math (EDGC §7)."""

import torch

from megatron_edgc.compression.activation import ActivationGradSender, decompress


def test_full_rank_round_trip_is_exact():
    g = torch.randn(16, 2, 32)                  # [seq, micro_batch, hidden]
    s = ActivationGradSender(rank=32)
    p, q = s.compress(g)
    out = decompress(p, q, g.shape, g.dtype)
    assert torch.allclose(out, g, atol=1e-5)
    assert s.residual.abs().max() < 1e-5


def test_lazy_error_propagation_conserves_the_sum():
    torch.manual_seed(0)
    s = ActivationGradSender(rank=2, seed=1)
    grads = [torch.randn(32, 1, 48) for _ in range(5)]
    sent = torch.zeros(32, 48)
    for g in grads:
        p, q = s.compress(g)
        sent += decompress(p, q, (32, 48), torch.float32)
    total = sum(g.view(32, 48) for g in grads)
    # what was sent + what is still owed = what was produced
    assert torch.allclose(sent + s.residual, total, atol=1e-4)


def test_warm_start_reaches_svd_optimum_on_a_repeated_gradient():
    torch.manual_seed(0)
    u, _ = torch.linalg.qr(torch.randn(64, 64))
    v, _ = torch.linalg.qr(torch.randn(40, 40))
    sv = torch.tensor([0.7 ** i for i in range(40)])
    m = (u[:, :40] * sv) @ v.T
    s = ActivationGradSender(rank=4, seed=3)
    for _ in range(6):
        if s.residual is not None:
            s.residual.zero_()                  # measure the approximation itself
        p, q = s.compress(m)
    err = torch.linalg.norm(m - p @ q.T)
    best = torch.linalg.svdvals(m)[4:].pow(2).sum().sqrt()
    assert err <= 1.1 * best


def test_bytes_and_rank_change():
    s = ActivationGradSender(rank=8, seed=0)
    s.compress(torch.randn(10, 1, 64))
    q8 = s.q.clone()
    s.set_rank(4)
    assert torch.equal(s.q, q8[:, :4])
    s.set_rank(6)
    assert s.q.shape == (64, 6) and torch.equal(s.q[:, :4], q8[:, :4])


def test_prepare_seeds_the_warm_start_before_the_first_send():
    """The runtime prepares each sender before the schedule: the first compressed send then
    seeds nothing inside backward, and gives bit for bit what an unprepared sender gives;
    preparing again keeps what was learnt."""
    prepared, plain = ActivationGradSender(4, seed=3), ActivationGradSender(4, seed=3)
    prepared.prepare(20, 48, torch.device("cpu"))
    assert prepared.q.shape == (48, 4) and prepared.residual.shape == (20, 48)
    assert prepared.residual.abs().sum() == 0
    grad = torch.randn(10, 2, 48, generator=torch.Generator().manual_seed(4))
    for a, b in zip(prepared.compress(grad), plain.compress(grad)):
        assert torch.equal(a, b)
    q, residual = prepared.q, prepared.residual
    prepared.prepare(20, 48, torch.device("cpu"))
    # the same tensors (views of the state's group): nothing re-seeded or re-allocated
    assert prepared.q.data_ptr() == q.data_ptr()
    assert prepared.residual.data_ptr() == residual.data_ptr()
