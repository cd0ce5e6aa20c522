"""Modules, caches and the HF patch shared between threads, and a fork while
another thread calls: never silently wrong, never hung. Races are drawn many
times; each test asserts what must hold on every draw."""

import copy
import os
import signal
import sys
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import rotary
from rotary_testing.reference import rope_reference, rotate_pairs_nd
from rotary_testing.scaling_reference import ref_frequencies

MODULES = [rotary.RotaryEmbedding, rotary.CppRotaryEmbedding]
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 16}


def _churn(rope, stop):
    """Calls that switch a dynamic rule's state back and forth."""
    x = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    while not stop.is_set():
        rope(x, 30)
        rope(x, 2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork() is POSIX")
@pytest.mark.parametrize("cls", MODULES)
def test_a_child_forked_while_another_thread_calls_can_call(cls):
    """A Python module's call waits for the GIL under the state machine's
    lock, so a fork copied it held by a thread the child does not have: the
    child hung on its first call (10 forks of 10). The lock is made anew in
    the child."""
    rope = cls(16, 32, scaling=DYNAMIC)
    stop = threading.Event()
    worker = threading.Thread(target=_churn, args=(rope, stop), daemon=True)
    worker.start()
    try:
        for _ in range(4):
            time.sleep(0.02)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads
                pid = os.fork()
            if pid == 0:  # the child: a hang ends at the alarm, with a failing status
                signal.alarm(20)
                x = torch.randn(1, 1, 1, 16, dtype=torch.float64)
                ok = torch.allclose(rope(x, 3), rope_reference(x, 3, interleaved=True), rtol=0, atol=1e-6)
                os._exit(0 if ok else 3)
            deadline = time.monotonic() + 60
            while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            if done[0] == 0:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung on the module's lock")
            assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        stop.set()
        worker.join(10)


@pytest.mark.parametrize("cls", MODULES)
def test_two_threads_appending_to_one_cache_are_served_or_refused(cls):
    """The Python module's append released the GIL between reading the
    length and advancing it: two threads wrote one row (8 trials of 10 lost
    rows silently). One writer at a time; the other is refused by name and
    writes nothing."""
    rope = cls(8, 1024)
    cache = rotary.KVCache(1, 1, 1024, 8)
    taken, refused = [], []
    start = threading.Barrier(2)

    def append(tag):
        start.wait()
        for step in range(200):
            q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
            v = torch.full((1, 1, 1, 8), float(tag * 1000 + step))
            try:
                rope.forward_with_cache(q, k, v, cache)
                taken.append(tag * 1000 + step)
            except RuntimeError as e:
                assert "another call is writing this KVCache (one writer at a time" in str(e), e
                refused.append(tag * 1000 + step)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=append, args=(tag,)) for tag in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(old)
    assert len(taken) + len(refused) == 400
    _, values = cache.keys_values()
    assert cache.length == len(taken)
    assert sorted(values[0, 0, :, 0].tolist()) == sorted(float(t) for t in taken)  # each served append, once


def test_share_memory_during_an_append_is_refused_not_a_lost_write():
    """share_memory() swapped the buffers' storage while an append on
    another thread wrote through the old one: rows lost with the length
    advanced (15 of 200 trials), or a write into freed memory. It now takes
    the writer's turn: served, or refused by name while an append runs."""
    rope = rotary.RotaryEmbedding(8, 256)
    refused = 0
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for trial in range(40):
            cache = rotary.KVCache(1, 1, 64, 8)
            start = threading.Barrier(2)

            def append():
                start.wait()
                for row in range(64):
                    while True:  # one writer at a time: the move's turn refuses an append too
                        q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
                        try:
                            rope.forward_with_cache(q, k, torch.full((1, 1, 1, 8), float(row)), cache)
                            break
                        except RuntimeError as e:
                            assert "another call is writing this KVCache" in str(e), e

            worker = threading.Thread(target=append)
            worker.start()
            start.wait()
            for _ in range(4):
                try:
                    cache.share_memory()
                except RuntimeError as e:
                    assert "KVCache.share_memory: another call is writing this KVCache" in str(e), e
                    refused += 1
            worker.join(60)
            _, values = cache.keys_values()
            assert cache.length == 64 and values[0, 0, :, 0].tolist() == [float(r) for r in range(64)], trial
    finally:
        sys.setswitchinterval(old)
    assert refused < 160  # some moves were served


def test_a_cast_on_another_thread_leaves_a_call_its_tables():
    """_apply popped the tables out of _buffers while nn.Module cast the
    rest: a call on another thread in that window raised KeyError: 'freqs',
    and state_dict() lacked them."""
    rope = rotary.RotaryEmbedding(8, 16)
    rope.register_buffer("other", torch.zeros(2))  # fn runs on it, with the tables where a call reads them
    seen = []

    def cast(t):
        seen.append(sorted(k for k in rope.state_dict() if k in ("freqs", "inv_freq")))
        return t.half()

    rope._apply(cast)
    assert seen and all(keys == ["freqs", "inv_freq"] for keys in seen) and rope.other.dtype == torch.float16
    assert rope.freqs.dtype == torch.complex64 and rope.inv_freq.dtype == torch.float64


def test_a_copy_taken_while_another_thread_switches_the_state_is_one_state():
    """deepcopy read freqs and inv_freq one by one while another thread
    installed new tables: a copy held state 0's table beside a grown
    inv_freq and rotated by the wrong one, silently (9 copies of 1500)."""
    rope = rotary.RotaryEmbedding(16, 32, scaling=DYNAMIC)
    stop = threading.Event()
    worker = threading.Thread(target=_churn, args=(rope, stop), daemon=True)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    worker.start()
    x = torch.randn(1, 1, 1, 16, dtype=torch.float64)
    try:
        copies = [copy.deepcopy(rope) for _ in range(300)]
    finally:
        stop.set()
        worker.join(10)
        sys.setswitchinterval(old)
    for c in copies:  # each turns by the float64 rule of the state the call ran in (it grows to 26 from 0)
        got = c(x, 25)
        inv, _ = ref_frequencies(16, 10000.0, DYNAMIC, c.rope_state)
        want = torch.from_numpy(rotate_pairs_nd(x.numpy(), 25.0 * np.array(inv)[None, :], interleaved=True))
        torch.testing.assert_close(got, want, rtol=0, atol=2e-7, msg=f"state {c.rope_state}")


def test_the_hf_patch_from_two_threads_at_once():
    """patch and unpatch read the model's state outside the lock: two threads
    unpatching B undid its patch twice (A, still patched, lost its
    apply_rotary_pos_emb; 47 trials of 100), and two patching one model left
    it patched with no way to unpatch (8 of 20)."""
    transformers = pytest.importorskip("transformers")
    from rotary.integrations.transformers import apply_rotary_to_model, is_patched, unpatch

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    a, b = transformers.LlamaForCausalLM(cfg).eval(), transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        want_a, want_b = a(ids).logits, b(ids).logits

    def twice(call):
        start, errors = threading.Barrier(2), []

        def run():
            start.wait()
            try:
                call()
            except BaseException as e:  # noqa: BLE001 (any error fails the test below)
                errors.append(e)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        apply_rotary_to_model(a)
        for _ in range(20):
            apply_rotary_to_model(b)
            twice(lambda: unpatch(b))
            assert not is_patched(b) and is_patched(a)
            with torch.no_grad():
                torch.testing.assert_close(a(ids).logits, want_a, rtol=1e-4, atol=1e-4)
            twice(lambda: apply_rotary_to_model(b))
            unpatch(b)
            assert not is_patched(b) and "forward" not in b.model.rotary_emb.__dict__
            with torch.no_grad():
                torch.testing.assert_close(b(ids).logits, want_b, rtol=1e-4, atol=1e-4)
    finally:
        sys.setswitchinterval(old)
        unpatch(a)
        unpatch(b)
