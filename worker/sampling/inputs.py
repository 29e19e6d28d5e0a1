"""What one step's sampled rows ask of the sampler, as packed arrays (the host's half).

Each sampled row's parameters become entries of a few arrays in the step's pack
(``worker.step.pack``): the rows that draw (with their temperature, top_k, top_p, min_p and the
uniform their seed gives), the rows with a repetition penalty, with presence or frequency
penalties, each logit_bias entry, each token min_tokens bans, the rows that want logprobs and
the constrained rows. ``DeviceSampler`` (``worker.sampling.device``) runs each kind as one
batched operation over its rows; a kind no row asks for costs nothing. What decides which
operations run (is any row drawing? adjusted? constrained?) is known here, on the host, so the
device never has to be asked.

Indices are positions among the step's sampled rows, in order. The uniforms come from
``(seed, output index)`` exactly as ``worker.sampling.sampler`` draws them, so a row's token depends
on neither the rest of the batch nor on whether its cache was recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.rows import Row
from worker.sampling.sampler import seeded_uniform
from worker.step.pack import HostPack

MAX_TOP_LOGPROBS = 20  # the sampler never returns more alternatives (protocol.params)


@dataclass
class SamplingPlan:
    """What the host knows of one step's sampling: which batched operations run, and what
    comes back for each row."""

    rows: int = 0  # S, the sampled rows
    drawing: bool = False  # some row draws (temperature > 0)
    repetition: bool = False
    presence: bool = False  # presence or frequency penalties
    bias: bool = False
    bans: bool = False  # min_tokens bans EOS and stop ids somewhere
    grammar: list[int] = field(default_factory=list)  # the constrained rows
    logprobs: list[int | None] = field(default_factory=list)  # per row: None, or its top N
    top: int = 0  # alternatives computed for every logprob row: the most any asks for

    @property
    def adjusts(self) -> bool:
        """Whether any row's scores differ from its raw logits before the argmax."""
        return self.repetition or self.presence or self.bias or self.bans or bool(self.grammar)

    @property
    def logprob_rows(self) -> list[int]:
        return [i for i, n in enumerate(self.logprobs) if n is not None]


def pack_sampling(
    pack: HostPack,
    rows: list[Row],
    slots: list[int],
    eos_token_ids: list[int],
    vocab: int,
    backs: list[int] | None = None,
) -> SamplingPlan:
    """Add the sampled ``rows``' parameters (the rows of these ``slots``) to ``pack`` (names
    ``s.*``); returns the plan. ``backs``: per sampled row, how many of its row's tokens fed
    this step come after the position it samples at (draft tokens after it; 0 by default), so
    its output index, and with it its seeded uniform and min_tokens, are that position's."""
    plan = SamplingPlan(rows=len(rows), logprobs=[row.params.logprobs for row in rows])
    backs = backs or [0] * len(rows)
    draw, temps, top_k, top_p, min_p, uniforms = [], [], [], [], [], []
    rep, rep_value, pres, pres_value, freq_value = [], [], [], [], []
    bias_row, bias_token, bias_value, ban_row, ban_token, fallback = [], [], [], [], [], []
    for i, (row, back) in enumerate(zip(rows, backs, strict=True)):
        params, outputs = row.params, len(row.history) - row.prompt_len - back
        if params.temperature > 0:
            draw.append(i)
            temps.append(params.temperature)
            top_k.append(vocab if params.top_k is None else min(params.top_k, vocab))
            # top_p >= 1 is "off": cumsum rounding must not trim the tail (worker.sampling.sampler)
            top_p.append(params.top_p if params.top_p < 1 else float("inf"))
            min_p.append(params.min_p)
            uniforms.append(seeded_uniform(row, outputs))
        if params.repetition_penalty != 1.0 and row.history:
            rep.append(i)
            rep_value.append(params.repetition_penalty)
        if (params.presence_penalty or params.frequency_penalty) and outputs:
            pres.append(i)
            pres_value.append(params.presence_penalty)
            freq_value.append(params.frequency_penalty)
        for token, value in (params.logit_bias or {}).items():
            if 0 <= token < vocab:
                bias_row.append(i)
                bias_token.append(token)
                bias_value.append(value)
        if outputs < params.min_tokens:
            banned = [t for t in eos_token_ids + params.stop_token_ids if 0 <= t < vocab]
            ban_row.extend([i] * len(banned))
            ban_token.extend(banned)
        if params.grammar is not None:
            plan.grammar.append(i)
            fallback.append(outputs < params.min_tokens)  # min_tokens may ban all it allows
    wanted = [n for n in plan.logprobs if n is not None]
    plan.top = min(max(wanted, default=0), MAX_TOP_LOGPROBS)
    plan.drawing, plan.repetition, plan.presence = bool(draw), bool(rep), bool(pres)
    plan.bias, plan.bans = bool(bias_row), bool(ban_row)
    f32, f64 = torch.float32, torch.float64
    arrays = {
        "s.slot": (slots, torch.int64),
        "s.draw": (draw, torch.int64),
        "s.temperature": (temps, f32),
        "s.top_k": (top_k, torch.int64),
        "s.top_p": (top_p, f32),
        "s.min_p": (min_p, f32),
        "s.uniform": (uniforms, f64),
        "s.rep": (rep, torch.int64),
        "s.rep_value": (rep_value, f32),
        "s.pres": (pres, torch.int64),
        "s.pres_value": (pres_value, f32),
        "s.freq_value": (freq_value, f32),
        "s.bias_row": (bias_row, torch.int64),
        "s.bias_token": (bias_token, torch.int64),
        "s.bias": (bias_value, f32),
        "s.ban_row": (ban_row, torch.int64),
        "s.ban_token": (ban_token, torch.int64),
        "s.grammar": (plan.grammar, torch.int64),
        "s.fallback": (fallback, torch.bool),
        "s.logprobs": (plan.logprob_rows, torch.int64),
    }
    for name, (values, dtype) in arrays.items():
        if values:  # a kind no row asks for is neither packed nor run
            pack.add(name, values, dtype)
    return plan
