"""``llmctl chat`` with a compute team: the answer is the same whatever the team's size does, the
team follows only the answer's steps, and is whole again when the answer ends."""

from __future__ import annotations

import io

import torch
from rich.console import Console

from llmctl.chat.repl import ChatRepl
from llmctl.chat.session import ChatSession
from llmctl.engine.compute_team import ComputeTeam
from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams


class FlippingTeam(ComputeTeam):
    """Switches between one and two threads on every decode step."""

    def on_decode_step(self, rows: int, seconds: float) -> None:
        self.steps = getattr(self, "steps", 0) + 1
        self._resize(1 if self.size == 2 else 2)


def answer(engine: LLMEngine, team: ComputeTeam | None) -> str:
    out = io.StringIO()
    session = ChatSession(engine.tokenizer, engine.max_model_len, 40)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    repl = ChatRepl(engine, session, params, Console(file=out, width=300, highlight=False), compute_team=team)
    repl.answer("Tell me a story about a robot.")
    return out.getvalue()


def test_answer_unchanged_and_team_restored():
    engine = LLMEngine(model="tiny-random-llama", kv_cache_memory=32 << 20, max_model_len=256, max_num_seqs=1)
    threads = torch.get_num_threads()
    sizes: list[int] = []
    team = FlippingTeam(2, lambda n: (sizes.append(n), torch.set_num_threads(n)), cpus=2)
    try:
        plain = answer(engine, None)
        with_team = answer(engine, team)
    finally:
        torch.set_num_threads(threads)
    assert plain and with_team == plain
    assert team.steps >= 38  # every decode step of the answer reached the team
    assert set(sizes) == {1, 2} and sizes[-1] == 2 and team.size == 2  # whole again after the answer
    assert team not in engine.stats.listeners
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
