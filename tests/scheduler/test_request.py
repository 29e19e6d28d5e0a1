"""Request's transitions: a request changes only through its own methods, each transition leaves
it as the audit expects, and a transition from the wrong state raises naming the request."""

from __future__ import annotations

import ast
import inspect

import pytest

import scheduler.prefix_cache
import scheduler.scheduler
from protocol.messages import PENDING_TOKEN, SamplingParams
from scheduler.request import Request, RequestStatus


def _request(prompt_len: int = 6) -> Request:
    return Request("r", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4), arrival=0)


def test_a_request_through_admission_decode_preemption_and_its_end() -> None:
    request = _request()
    request.admit(2, [7, 8])
    request.take_cached(1, 4)  # its first block was a prefix-cache hit
    assert (request.status, request.slot, request.admission_blocks) == (RequestStatus.RUNNING, 2, 2)
    assert (request.num_computed, request.num_blocks_cached, request.num_cached_tokens) == (4, 1, 4)
    assert request.advance(2) == ([7, 8], True)  # the rest of the prompt, then a sample
    assert (request.num_computed, request.num_pending, request.num_tokens) == (6, 1, 7)
    assert request.token_slice(6, 7) == [PENDING_TOKEN]
    request.sampled(42)
    assert request.output_token_ids == [42] and request.num_pending == 0
    request.grow([9])
    assert request.advance(1) == ([9], True)  # the row hears of the new block with the step
    request.release()
    request.requeue()  # preempted: tokens kept, pending sample dropped, epoch moved on
    assert (request.status, request.slot, request.block_ids) == (RequestStatus.WAITING, None, [])
    assert (request.num_computed, request.num_pending, request.epoch) == (0, 0, 1)
    assert request.high_water == 7 and request.num_tokens == 7
    request.admit(0, [3, 4])
    request.take_cached(0, 4)
    assert request.num_cached_tokens == 4  # its first admission's hits, kept
    request.release()
    request.finish("length")
    assert (request.status, request.finish_reason) == (RequestStatus.FINISHED, "length")
    aborted = _request()
    aborted.finish("abort")
    assert aborted.status is RequestStatus.ABORTED


def test_admitting_a_running_request_raises() -> None:
    request = _request()
    request.admit(0, [1, 2])
    with pytest.raises(RuntimeError, match="request r is admitted twice"):
        request.admit(1, [3, 4])


def test_a_sample_with_nothing_pending_raises() -> None:
    request = _request()
    request.admit(0, [1, 2])
    with pytest.raises(RuntimeError, match="request r has no pending token"):
        request.sampled(5)


def test_ending_while_holding_a_slot_or_blocks_raises() -> None:
    request = _request()
    request.admit(0, [1, 2])
    with pytest.raises(RuntimeError, match="request r ends holding a slot or blocks"):
        request.finish("stop")


def _field_writes(source: str) -> list[str]:
    """``name.attr`` for every assignment to an attribute of anything but ``self``."""
    writes = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for leaf in ast.walk(target):
                if (
                    isinstance(leaf, ast.Attribute)
                    and isinstance(leaf.value, ast.Name)
                    and leaf.value.id != "self"
                ):
                    writes.append(f"{leaf.value.id}.{leaf.attr}")
    return writes


def test_the_scheduler_and_the_prefix_cache_never_write_a_requests_fields() -> None:
    assert _field_writes("request.slot = 1\nvictim.block_ids += [2]\nself.ok = 3") == [
        "request.slot",
        "victim.block_ids",
    ]
    for module in (scheduler.scheduler, scheduler.prefix_cache):
        assert _field_writes(inspect.getsource(module)) == [], module.__name__
