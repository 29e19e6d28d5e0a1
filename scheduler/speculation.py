"""Speculation: which requests draft, their drafts, and which drafts a step's samples accept.

The scheduler asks ``drafts`` for each running request it is about to decode, and ``verify``
when a step with drafts comes back. Acceptance is exact for greedy and for sampled requests
alike: the worker samples at every position of the draft item as it would have without drafts
(the same processors, and for a sampled row the uniform fixed by its seed and the output index),
and a draft token is accepted while it equals the token sampled before it. With a deterministic
drafter (q one-hot on the draft) that is rejection sampling: the draft d is accepted with
probability p(d) = min(1, p(d)/q(d)), and on rejection the token sampled is drawn from p less d,
renormalized, which is the residual max(0, p - q) normalized. So a seeded request gives the
same text with or without speculation (docs/speculative.md).

No request drafts while more than ``max_running`` run (``--speculative-max-running``): each
draft is one more row of the step's arithmetic (on a GPU the step also runs without its CUDA
graphs), which costs every row of a busy batch, and a request that drafts sits out the step
planned while its verification flies.

Requests that never draft: those with repetition, presence or frequency penalties, or asking
for logprobs (the worker would have to roll those states back per position), those with a
grammar and ``min_tokens`` (where the grammar's fallback reads the row's output count), and
those whose ``num_speculative_tokens`` resolves to 0. A grammar's drafts are checked in the
worker: the mask at each draft position is the matcher's after the drafts before it, so a
draft token the grammar forbids is never accepted and ends the draft there.
"""

from __future__ import annotations

from scheduler.drafter import DraftState
from scheduler.request import Request

STEP_WEIGHT = 0.2  # of the latest step in the moving averages of steps' worker time


class Speculation:
    """The n-gram drafter's policy and counters, for one scheduler."""

    def __init__(self, num_tokens: int = 0, max_running: int = 8) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_tokens}")
        self.num_tokens = num_tokens  # the default k; a request's params may override it
        self.max_running = max_running  # no drafts while more requests run
        self.plain_step_s: float | None = None  # decode steps' worker time, moving average
        self.drafted_step_s: float | None = None  # the same of steps that verify drafts
        self.drafts_total = 0  # verifications
        self.draft_tokens_total = 0
        self.accepted_total = 0

    def limit(self, request: Request) -> int:
        """The most draft tokens ``request`` may carry in one step (0: it never drafts)."""
        params = request.params
        k = params.num_speculative_tokens
        k = self.num_tokens if k is None else k
        if not k or params.logprobs is not None:
            return 0
        if params.grammar is not None and params.min_tokens:
            return 0
        if params.repetition_penalty != 1.0 or params.presence_penalty:
            return 0
        return 0 if params.frequency_penalty else k

    def may_draft(self, request: Request) -> bool:
        """A cheap first test, on fields: whether ``request`` may draft at all (False for
        every request while speculation is off and no request asks for it)."""
        return bool(
            request.num_draft
            or request.drafting is not None
            or self.num_tokens
            or request.params.num_speculative_tokens
        )

    def wants(self, request: Request) -> DraftState | None:
        """The request's drafter, if it drafts now (not paused; made at its first ask)."""
        state = request.drafting
        if state is None:
            if not self.limit(request):
                return None
            state = request.drafting = DraftState()
        return None if state.paused else state

    def drafts(self, request: Request, room: int, max_model_len: int) -> list[int]:
        """Draft tokens for ``request``'s next step: at most its limit, ``room`` (the token
        budget left) and what ``max_tokens`` and ``max_model_len`` leave after the token the
        step samples anyway. Looked up after its known tokens; when its last token is still
        pending (a plain decode in flight) the lookup's first token is the guess for it, and
        the drafts are the tokens after that guess (a wrong guess only costs their rejection:
        verification never trusts a draft)."""
        state = self.wants(request)
        if state is None:
            return []
        params = request.params
        final = min(request.num_prompt_tokens + params.max_tokens, max_model_len)
        k = min(self.limit(request), room, final - 1 - request.num_tokens)
        if k < 1:
            return []
        pending = request.num_pending  # 0, or 1: drafts never follow drafts in flight
        found = state.index.propose(request.token_slice, request.num_known_tokens, k + pending)
        return found[pending:]

    def paused_step(self, request: Request) -> None:
        """``request`` is planned a plain decode; a pause counts down by one step."""
        state = request.drafting
        if state is not None and state.paused:
            state.tick()

    def verify(self, request: Request, drafts: tuple[int, ...], sampled: list[int]) -> int:
        """How many of ``drafts`` the tokens ``sampled`` at each position (one more than the
        drafts) accept; counted, and fed back to the request's drafter."""
        if len(sampled) != len(drafts) + 1:
            raise RuntimeError(
                f"request {request.request_id}: {len(sampled)} samples for {len(drafts)} drafts"
            )
        accepted = 0
        while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
            accepted += 1
        self.drafts_total += 1
        self.draft_tokens_total += len(drafts)
        self.accepted_total += accepted
        if request.drafting is not None:
            request.drafting.verified(accepted + 1, self.verification_cost)
        return accepted

    def observe(self, seconds: float, drafted: bool) -> None:
        """A step of decodes (and verifications, ``drafted``) took the worker ``seconds``
        (``StepResult.forward_s``): the moving averages behind ``verification_cost``."""
        name = "drafted_step_s" if drafted else "plain_step_s"
        old = getattr(self, name)
        setattr(self, name, seconds if old is None else old + STEP_WEIGHT * (seconds - old))

    @property
    def verification_cost(self) -> float:
        """What a step with drafts costs in steps without them, at least 1 (1 until both have
        been seen): about 1 where the weights' streaming bounds a step (a GPU), 2 to 3 for 4
        drafts on a 2-core CPU's 4-bit kernels, where each row adds its arithmetic."""
        if self.plain_step_s is None or self.drafted_step_s is None:
            return 1.0
        return max(1.0, self.drafted_step_s / max(self.plain_step_s, 1e-9))

    def left_out(self, requests: list[Request]) -> None:
        """A step was planned without these requests, whose verifications are in flight."""
        for request in requests:
            if request.drafting is not None:
                request.drafting.skipped += 1
