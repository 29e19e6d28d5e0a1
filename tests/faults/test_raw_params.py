"""Sampling parameters from a raw peer, against a real scheduler process with a raw worker: a
non-finite or out-of-range value never decodes (it is counted and dropped, like garbage), a
value outside the worker's limits is refused with an error output, and none reaches the worker,
while a good request in the same stream is stepped."""

from __future__ import annotations

import math
import time

import zmq

from protocol.addresses import default_addresses
from protocol.messages import (
    PROTOCOL_VERSION,
    AddRequest,
    FrontendHello,
    Heartbeat,
    Outputs,
    SamplingParams,
    SchedulerToFrontend,
    SchedulerToWorker,
    StepInput,
)
from tests.faults.raw import ENCODE, announcement, dealer, first_info, received

NAN, INF = math.nan, math.inf
UNDECODABLE = [  # SamplingParams.__init__ takes them; no decoder does
    SamplingParams(temperature=NAN),
    SamplingParams(temperature=INF),
    SamplingParams(top_p=NAN),
    SamplingParams(min_p=INF),
    SamplingParams(repetition_penalty=INF),
    SamplingParams(repetition_penalty=NAN),
    SamplingParams(presence_penalty=NAN),
    SamplingParams(frequency_penalty=-INF),
    SamplingParams(logit_bias={1: NAN}),
    SamplingParams(logit_bias={1: INF}),
    SamplingParams(logit_bias={-1: 1.0}),
    SamplingParams(logprobs=21),
    SamplingParams(top_k=0),
    SamplingParams(stop_token_ids=[-1]),
    SamplingParams(max_tokens=0),
]
REFUSED = {  # they decode, but break this worker's vocabulary or a rule across fields
    "prompt-vocab": ([100], SamplingParams(), "prompt token ids"),
    "stop-vocab": ([1], SamplingParams(stop_token_ids=[100]), "stop token ids"),
    "bias-vocab": ([1], SamplingParams(logit_bias={100: 1.0}), "logit_bias token"),
    "min-tokens": ([1], SamplingParams(min_tokens=3, max_tokens=2), "min_tokens"),
}


def test_bad_params_from_a_raw_frontend_never_reach_the_worker(lone_scheduler):
    addresses = default_addresses(lone_scheduler.run_id)
    context = zmq.Context()
    try:
        frontend = dealer(context, addresses.frontend)
        frontend.send(ENCODE(FrontendHello(protocol_version=PROTOCOL_VERSION, frontend_id="raw")))
        assert not first_info(frontend).worker_ready
        worker = dealer(context, addresses.worker, identity=b"raw-worker")
        worker.send(ENCODE(announcement(PROTOCOL_VERSION)))
        assert first_info(frontend).worker_ready
        for index, params in enumerate(UNDECODABLE):
            add = AddRequest(request_id=f"bad-{index}", prompt_token_ids=[1, 2], params=params)
            frontend.send(ENCODE(add))
        for request_id, (prompt, params, _) in REFUSED.items():
            frontend.send(
                ENCODE(AddRequest(request_id=request_id, prompt_token_ids=prompt, params=params))
            )
        good = AddRequest(request_id="good", prompt_token_ids=[1, 2], params=SamplingParams())
        frontend.send(ENCODE(good))
        worker.send(ENCODE(Heartbeat(sender="raw-worker", time=time.time())))
        errors, stats = {}, None
        deadline = time.monotonic() + 10
        while len(errors) < len(REFUSED) and time.monotonic() < deadline:
            for message in received(frontend, SchedulerToFrontend, 0.2):
                if isinstance(message, Outputs) and message.outputs:
                    errors.update({o.request_id: o for o in message.outputs})
                    stats = message.stats
        assert set(errors) == set(REFUSED)  # no output names an undecodable request
        for request_id, (_, _, why) in REFUSED.items():
            assert errors[request_id].finish_reason == "error", request_id
            assert why in errors[request_id].error, errors[request_id].error
        assert stats is not None and stats.bad_messages_total == len(UNDECODABLE)
        steps = [m for m in received(worker, SchedulerToWorker, 1.0) if isinstance(m, StepInput)]
        assert steps and {item.request_id for step in steps for item in step.items} == {"good"}
    finally:
        context.destroy(linger=0)
    log = (lone_scheduler.log_dir / "scheduler.log").read_text()
    assert log.count("dropped a bad message") == len(UNDECODABLE)
    lone_scheduler.check_alive()
