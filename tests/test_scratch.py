"""analyses.scratch: buffers kept between calls, by name, per thread, within a limit, on the CPU only."""
from __future__ import annotations

import threading

import pytest
import torch

from probe.analyses import scratch


@pytest.fixture(autouse=True)
def empty():
    scratch.release()
    yield
    scratch.release()


def test_a_name_reuses_its_buffer_for_any_shape_that_fits_and_grows_for_one_that_does_not():
    first = scratch.scratch("a", (4, 8), torch.float32, torch.device("cpu"))
    assert first.shape == (4, 8) and first.dtype == torch.float32
    smaller = scratch.scratch("a", (3, 5), torch.float32, "cpu")
    assert smaller.shape == (3, 5) and smaller.data_ptr() == first.data_ptr()
    assert scratch.held_bytes() == 4 * 8 * 4
    larger = scratch.scratch("a", (10, 10), torch.float32, "cpu")
    assert larger.shape == (10, 10) and scratch.held_bytes() == 100 * 4
    assert scratch.scratch("a", (2,), torch.float32, "cpu").data_ptr() == larger.data_ptr()
    # another name or another dtype is another buffer
    other = scratch.scratch("b", (4, 8), torch.float32, "cpu")
    half = scratch.scratch("a", (4, 8), torch.float16, "cpu")
    assert len({larger.data_ptr(), other.data_ptr(), half.data_ptr()}) == 3
    assert scratch.held_bytes() == 100 * 4 + 32 * 4 + 32 * 2


def test_nothing_beyond_the_limit_is_kept(monkeypatch):
    monkeypatch.setattr(scratch, "LIMIT_BYTES", 1000)
    kept = scratch.scratch("a", (200,), torch.float32, "cpu")  # 800 bytes: kept
    big = scratch.scratch("b", (100,), torch.float32, "cpu")  # 400 more: over the limit, a fresh tensor each time
    assert scratch.scratch("b", (100,), torch.float32, "cpu").data_ptr() != big.data_ptr()  # `big` is alive
    assert scratch.held_bytes() == 800
    assert scratch.scratch("a", (200,), torch.float32, "cpu").data_ptr() == kept.data_ptr()


def test_each_thread_has_its_own_buffers():
    here = scratch.scratch("a", (16,), torch.float32, "cpu")
    there = {}

    def other():
        there["ptr"] = scratch.scratch("a", (16,), torch.float32, "cpu").data_ptr()
        there["held"] = scratch.held_bytes()

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert there["ptr"] != here.data_ptr() and there["held"] == 64
    assert scratch.held_bytes() == 64  # the other thread's buffer is not this one's


def test_a_buffer_made_in_inference_mode_is_usable_outside_it():
    with torch.inference_mode():
        scratch.scratch("a", (8,), torch.float32, "cpu").fill_(1.0)
    again = scratch.scratch("a", (8,), torch.float32, "cpu")
    assert not again.is_inference()
    again.mul_(2.0)  # an inference tensor would refuse this outside inference mode
    torch.testing.assert_close(again, torch.full((8,), 2.0))


def test_other_devices_get_fresh_tensors_and_release_frees_everything():
    meta = scratch.scratch("a", (4, 4), torch.float32, torch.device("meta"))
    assert meta.device.type == "meta" and meta.shape == (4, 4) and scratch.held_bytes() == 0
    scratch.scratch("a", (4, 4), torch.float32, "cpu")
    assert scratch.held_bytes() == 64 and len(scratch.held()) == 1
    scratch.release()
    assert scratch.held_bytes() == 0 and scratch.held() == []
