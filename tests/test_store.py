"""The activation store: exact byte counts, release at B and W, offload and reload on the CPU path."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from optpipe.runtime.model import CONFIGS, build_model, split_stages
from optpipe.runtime.split_backward import StageGrad, touch_saved_tensors
from optpipe.runtime.store import ActivationStore

torch.set_num_threads(1)

CONFIG = CONFIGS["tiny"]


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def test_counts_each_saved_storage_once_and_skips_parameters():
    w = nn.Parameter(torch.randn(8, 8))
    store = ActivationStore("cpu", exclude=[w])
    x = torch.randn(4, 8, requires_grad=True)
    with store.capture(0, 0):
        h = x @ w  # saves x (and w: a parameter, not counted)
        y = (h * h).sum()  # saves h twice: one storage
        z = x[1:] * 2.0  # a view of x: x's storage again, saved by nothing here (a scalar factor)
        u = torch.tanh(x[:2])  # tanh saves its output, a new storage
    expected = _nbytes(x) + _nbytes(h) + _nbytes(u)
    assert store.resident == store.peak == expected
    assert store.entry_bytes(0, 0) == expected
    (y + z.sum() + u.sum()).backward()
    assert w.grad is not None


def test_forget_releases_what_w_does_not_need_and_drop_the_rest():
    model = build_model(CONFIG, seed=0)
    stage = split_stages(model, 4)[1]
    runner = StageGrad(stage)
    store = ActivationStore("cpu", exclude=list(model.parameters()))
    x = torch.randn(CONFIG.micro_batch_size, CONFIG.seq_len, CONFIG.n_embd, requires_grad=True)
    with store.capture(1, 0):
        fwd = runner.forward(x)
    saved = store.resident
    dx, work = runner.backward_input(fwd, [fwd.output], [torch.ones_like(fwd.output)])
    with store.census() as needed:
        touch_saved_tensors(work.nodes())
    released = store.forget(1, 0, needed)
    assert 0 < released < saved  # GELU's input, attention's q, k, v and output go; matmul inputs stay
    assert store.resident == saved - released == store.entry_bytes(1, 0)
    StageGrad.backward_weight(work)  # would raise if it needed a released tensor
    assert all(p.grad is not None for p in stage.parameters())
    assert store.drop(1, 0) == saved - released
    assert store.resident == 0 and store.peak == saved and store.live_entries == 0


def test_released_storage_is_really_emptied():
    store = ActivationStore("cpu")
    x = torch.randn(64, requires_grad=True)
    with store.capture(0, 0):
        y = torch.sigmoid(x)  # saves its output
    storage = y.untyped_storage()
    assert storage.nbytes() == 64 * 4
    store.forget(0, 0, keep=frozenset())
    assert storage.nbytes() == 0 and store.resident == 0


def _offload_round_trip(offload: bool, store: ActivationStore, stage, runner, x, dy, key):
    with store.capture(*key):
        fwd = runner.forward(x.clone().requires_grad_())
    if offload:
        store.offload(*key)
        saved = store.resident
        released = store.wait_offload(*key)
        assert released > 0 and store.resident == saved - released
        store.reload(*key)
        assert store.resident == saved
        store.wait_reload(*key)
    dx = runner.backward(fwd, [fwd.output], [dy])
    store.drop(*key)
    return dx[0]


def test_offload_and_reload_give_the_same_gradients_and_reuse_host_buffers():
    torch.manual_seed(0)
    x = torch.randn(CONFIG.micro_batch_size, CONFIG.seq_len, CONFIG.n_embd)
    dy = torch.randn_like(x)
    results = {}
    for offload in (False, True):
        model = build_model(CONFIG, seed=0)
        stage = split_stages(model, 4)[2]
        runner = StageGrad(stage)
        store = ActivationStore("cpu", exclude=list(model.parameters()))
        dxs = [_offload_round_trip(offload, store, stage, runner, x, dy, (2, i)) for i in range(3)]
        results[offload] = (dxs, {n: p.grad.clone() for n, p in stage.named_parameters()}, store)
    (plain_dx, plain_grads, _), (moved_dx, moved_grads, store) = results[False], results[True]
    for a, b in zip(plain_dx, moved_dx):
        assert torch.equal(a, b)
    for name in plain_grads:
        assert torch.equal(plain_grads[name], moved_grads[name]), name
    stats = store.stats()
    blocks = stats.host_buffers_allocated
    assert blocks > 0 and stats.host_buffers_reused == 2 * blocks  # microbatches 1 and 2 reuse 0's buffers
    assert stats.resident_bytes == 0


def test_backward_on_an_offloaded_activation_is_a_clear_error():
    store = ActivationStore("cpu")
    x = torch.randn(16, requires_grad=True)
    with store.capture(3, 1):
        y = torch.exp(x).sum()
    store.offload(3, 1)
    store.wait_offload(3, 1)
    with pytest.raises(RuntimeError, match="stage 3 microbatch 1 is not on the device"):
        y.backward()


def test_a_storage_shared_by_two_entries_is_counted_once_and_stays_until_both_let_go():
    store = ActivationStore("cpu")
    x = torch.randn(32, requires_grad=True)
    with store.capture(0, 0):
        a = torch.sigmoid(x)  # saves a
    hand_over = a.detach().requires_grad_()  # the next stage's input on the same rank
    with store.capture(1, 0):
        b = hand_over * hand_over  # saves the same storage again
    assert store.resident == _nbytes(a)
    store.offload(1, 0)  # shared: it stays on the device
    assert store.wait_offload(1, 0) == 0
    store.reload(1, 0)
    store.wait_reload(1, 0)
    assert store.drop(0, 0) == 0 and store.resident == _nbytes(a)
    assert store.drop(1, 0) == _nbytes(a) and store.resident == 0
    del b


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the CUDA path (pinned pool, copy streams, events) needs a GPU")
def test_cuda_offload_round_trip():
    device = torch.device("cuda")
    store = ActivationStore(device)
    x = torch.randn(1 << 20, device=device, requires_grad=True)
    for i in range(2):
        with store.capture(0, i):
            y = torch.sigmoid(x)
        before = torch.cuda.memory_allocated(device)
        store.offload(0, i)
        store.wait_offload(0, i)
        torch.cuda.synchronize(device)
        assert torch.cuda.memory_allocated(device) < before  # the device memory really went
        store.reload(0, i)
        store.wait_reload(0, i)
        (grad,) = torch.autograd.grad(y.sum(), x)
        torch.testing.assert_close(grad, torch.sigmoid(x) * (1 - torch.sigmoid(x)))
        store.drop(0, i)
    assert store.pool.pin and store.stats().host_buffers_reused >= 1


def test_the_graph_b_and_w_retain_is_freed_after_w():
    """B and W keep the graph (retain_graph), so nothing may tie a saved tensor to its own node:
    a saved output would hold its grad_fn, which holds the saved output, and nothing would be freed."""
    import gc

    from optpipe.runtime.store import _Saved

    model = build_model(CONFIG, seed=0)
    stage = split_stages(model, 4)[3]  # the head: log-softmax saves its output
    runner = StageGrad(stage)
    store = ActivationStore("cpu", exclude=list(model.parameters()))
    targets = torch.randint(0, CONFIG.vocab_size, (CONFIG.micro_batch_size, CONFIG.seq_len))
    for i in range(3):
        x = torch.randn(CONFIG.micro_batch_size, CONFIG.seq_len, CONFIG.n_embd, requires_grad=True)
        with store.capture(3, i):
            fwd = runner.forward(x)
            loss = torch.nn.functional.cross_entropy(fwd.output.flatten(0, 1), targets.flatten())
        _, work = runner.backward_input(fwd, [loss], [None])
        StageGrad.backward_weight(work)
        store.drop(3, i)
        del fwd, loss, work, x
    gc.collect()
    assert sum(1 for o in gc.get_objects() if type(o) is _Saved) == 0
