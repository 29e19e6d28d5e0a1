"""Packed step inputs (``worker.step.pack``): every array comes back as it went in, from one
copy; a staging buffer is written again only once the copy that read it is done; outputs come
back in one copy; and a worker's step crosses to the device in exactly one copy."""

from __future__ import annotations

import pytest
import torch

from protocol.messages import SamplingParams
from tests.worker.conftest import make_worker
from tests.worker.driver import Driver, Request
from worker.step import pack as step_pack
from worker.step.fences import Fence
from worker.step.pack import ALIGN, Staging, download


def test_every_array_comes_back_as_it_went_in():
    torch.manual_seed(0)
    staging = Staging("cpu", pin=False, initial=64)  # too small: it grows
    pack = staging.pack()
    values = {
        "ids": ([5, 0, 7, 2**40], torch.int64, None),
        "empty": ([], torch.int64, None),
        "temps": ([0.5, 1.25], torch.float32, None),
        "uniform": ([0.123456789012345], torch.float64, None),
        "flags": ([True, False, True], torch.bool, None),
        "table": (list(range(12)), torch.int64, (3, 4)),
    }
    for name, (data, dtype, shape) in values.items():
        pack.add(name, data, dtype, shape)
    bias = torch.randn(2, 3, 5).to(torch.bfloat16)
    mask = torch.rand(4, 6) > 0.5
    pack.add("bias", bias)
    pack.add("mask", mask)
    packed = pack.upload()
    assert staging.uploads == 1
    for name, (data, dtype, shape) in values.items():
        view = packed[name]
        assert view.dtype == dtype and tuple(view.shape) == (shape or (len(data),))
        assert view.reshape(-1).tolist() == pytest.approx(data)
        assert view.data_ptr() % ALIGN == 0 or not data
    assert torch.equal(packed["bias"], bias) and torch.equal(packed["mask"], mask)
    assert packed.get("missing") is None and "ids" in packed


def test_a_pack_refuses_a_name_twice_and_a_wrong_shape():
    pack = Staging("cpu", pin=False).pack()
    pack.add("ids", [1, 2])
    with pytest.raises(ValueError, match="already holds 'ids'"):
        pack.add("ids", [3])
    with pytest.raises(ValueError, match="3 values do not make the shape"):
        pack.add("table", [1, 2, 3], shape=(2, 2))


class RecordingFence(Fence):
    """A fence that is not done until waited for, and says when it was."""

    waited: list[int] = []
    made = 0

    def __init__(self) -> None:
        RecordingFence.made += 1
        self.number = RecordingFence.made
        self.finished = False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        RecordingFence.waited.append(self.number)
        self.finished = True


def test_a_buffer_is_written_again_only_after_the_copy_that_read_it(monkeypatch):
    monkeypatch.setitem(step_pack.FENCES, "cpu", RecordingFence)
    RecordingFence.waited, RecordingFence.made = [], 0
    staging = Staging("cpu", pin=False, slots=2)
    for step in range(4):
        pack = staging.pack()
        pack.add("ids", [step])
        assert pack.upload()["ids"].tolist() == [step]
    # Steps 2 and 3 reused the buffers of steps 0 and 1: each waited for that copy's fence.
    assert RecordingFence.waited == [1, 2]


def test_outputs_come_back_in_one_copy():
    tokens = torch.tensor([3, 1, 4])
    logprob = torch.tensor([-0.5, -1.5], dtype=torch.float32)
    top = torch.tensor([[1, 2, 3], [4, 5, 6]])
    host, fence = download([tokens, logprob, top[:, :2]], pin=False)
    fence.wait()
    assert fence.done()
    assert [t.tolist() for t in host] == [[3, 1, 4], [-0.5, -1.5], [[1, 2], [4, 5]]]
    assert host[0].untyped_storage().data_ptr() == host[2].untyped_storage().data_ptr()


def test_a_step_crosses_in_one_copy(tiny_dir):
    """Every step, decodes and prefills with penalties, bias and logprobs alike, is one upload."""
    worker = make_worker(tiny_dir)
    params = SamplingParams(
        temperature=0.8, seed=3, repetition_penalty=1.2, logit_bias={5: 2.0}, logprobs=2
    )
    driver = Driver(worker, eos=[])
    before = worker.runner.staging.uploads
    driver.run([Request("a", [1, 2, 3, 4, 5], 4, params), Request("b", [1, 9], 3)], chunk=3)
    assert worker.runner.staging.uploads - before == driver.step_id - 1  # the last one is empty
