"""Batching measurements with no model in them: what a watermark moves is preemptions and
iterations, integers the scheduler computes without a tensor in sight. Each point also runs
without prefix caching, to show the recompute that preempted requests save by hitting their own
cached blocks."""

from __future__ import annotations

from dataclasses import dataclass, replace

from protocol.blocks import blocks_for
from protocol.messages import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.sim_worker import SimWorker
from scheduler.soak import make_prompts, soak


@dataclass(frozen=True)
class WatermarkPoint:
    """One reserve size's cost on one workload."""

    reserve_blocks: int
    evictions: int
    thrashed: int
    iterations: int
    recompute_share: float
    same_text: bool  # outputs identical to a pool that never preempts
    recompute_share_uncached: float = 0.0  # the same run without prefix caching

    def row(self) -> str:
        """One line of the sweep table."""
        unit = "block" if self.reserve_blocks == 1 else "blocks"
        return (
            f"{self.reserve_blocks} {unit}\t{self.evictions}\t{self.thrashed}\t"
            f"{self.iterations}\t{self.recompute_share:.1%}\t"
            f"{self.recompute_share_uncached:.1%}\t{'same' if self.same_text else 'DIFFERENT'}"
        )


TABLE_HEADER = (
    "reserve\tevictions\tof those, thrash\titerations\trecompute share\t"
    "without prefix caching\ttext"
)


def sweep_watermarks(
    reserves: list[int],
    *,
    num_requests: int = 8,
    num_slots: int = 3,
    num_blocks: int = 8,
    block_size: int = 4,
    token_budget: int = 10,
    prompt_len: int = 6,
    max_tokens: int = 9,
    seed: int = 0,
) -> list[WatermarkPoint]:
    """Run one seeded workload through each reserve size (audited) and count what changed."""
    prompts = make_prompts(num_requests, prompt_len, vocab_size=1000, seed=seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    roomy_blocks = num_requests * blocks_for(prompt_len + max_tokens, block_size)
    baseline = soak(
        SimWorker(roomy_blocks, block_size, num_requests),
        SchedulerConfig(token_budget=num_requests * (prompt_len + max_tokens), watermark_blocks=0),
        prompts,
        params,
    )
    points = []
    for reserve in reserves:
        worker = SimWorker(num_blocks, block_size, num_slots)
        config = SchedulerConfig(token_budget=token_budget, watermark_blocks=reserve)
        report = soak(worker, config, prompts, params)
        uncached = soak(
            SimWorker(num_blocks, block_size, num_slots),
            replace(config, enable_prefix_caching=False),
            prompts,
            params,
        )
        points.append(
            WatermarkPoint(
                reserve,
                report.evictions,
                report.thrashed_admissions,
                report.iterations,
                report.recompute_share,
                report.outputs == baseline.outputs and uncached.outputs == baseline.outputs,
                uncached.recompute_share,
            )
        )
    return points
