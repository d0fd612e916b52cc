"""The engine's throughput and state in a log line every few seconds, as vLLM's engine logs them
(`exl3serve-openai --log-stats-interval`, default 10 s; `--disable-log-stats` turns them off):

    Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.0 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, GPU KV cache usage: 3.1%, Prefix cache hit rate: 40.0%

(one line). The throughputs are the tokens this process handed through since the previous line
(TokenTally: a request's prompt once its first token came, every generated token), per second;
running, waiting and KV cache usage are the engine's (Generator.EngineStats) as it answers, the
prefix cache hit rate its hits over its queries since the previous line. A line is written where
the interval saw tokens or the engine has requests, so an idle server stays quiet (as vLLM's
INFO lines do). With --workers each process writes its own (its own requests' throughput, the
engine's state), named by its pid. With --log-format json the line is a JSON object."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Awaitable, Callable, Optional

from exl3serve.v1 import exl3serve_pb2 as pb

from .access import AccessLogWriter
from .log_format import LogFormat, json_time
from .vllm_metrics import TokenTally

DEFAULT_LOG_STATS_INTERVAL_S = 10.0


class StatsLog:
    """Writes the line every `interval_s` while run() runs (a task of the front end's lifespan).
    `engine_stats` asks the engine for its state (None where it does not answer)."""

    def __init__(self, tally: TokenTally,
                 engine_stats: Callable[[], Awaitable[Optional[pb.EngineStatsResponse]]],
                 writer: AccessLogWriter, interval_s: float, worker: bool = False) -> None:
        self.tally = tally
        self.engine_stats = engine_stats
        self.writer = writer
        self.interval_s = interval_s
        self.name = f"Front-end worker {os.getpid()}, engine 000" if worker else "Engine 000"

    async def run(self) -> None:
        prompt, generation = self.tally.prompt, self.tally.generation
        seen: Optional[tuple[int, int]] = None  # the prefix cache's queries and hits last time
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            stats = await self.engine_stats()
            now = time.monotonic()
            elapsed = max(now - last, 1e-9)
            new_prompt = self.tally.prompt - prompt
            new_generation = self.tally.generation - generation
            prompt, generation, last = self.tally.prompt, self.tally.generation, now
            hit_rate = 0.0
            if stats is not None:
                queries, hits = stats.prefix_cache_queried_tokens, stats.prefix_cache_hit_tokens
                if seen is not None and queries > seen[0]:
                    hit_rate = (hits - seen[1]) / (queries - seen[0])
                seen = (queries, hits)
            running = stats.num_requests_running if stats is not None else 0
            waiting = stats.num_requests_waiting if stats is not None else 0
            if not (new_prompt or new_generation or running or waiting):
                continue  # idle: no line
            self.write(new_prompt / elapsed, new_generation / elapsed, stats, hit_rate)

    def write(self, prompt_tps: float, generation_tps: float,
              stats: Optional[pb.EngineStatsResponse], hit_rate: float) -> None:
        if self.writer.fmt is LogFormat.JSON:
            out = {"time": json_time(time.time()), "type": "stats", "name": self.name,
                   "prompt_throughput": round(prompt_tps, 1),
                   "generation_throughput": round(generation_tps, 1)}
            if stats is not None:
                out.update(running=stats.num_requests_running,
                           waiting=stats.num_requests_waiting,
                           kv_cache_usage_perc=round(100 * stats.kv_cache_usage, 1),
                           prefix_cache_hit_rate_perc=round(100 * hit_rate, 1))
            self.writer.out(json.dumps(out))
            return
        line = (f"{self.name}: Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
                f"Avg generation throughput: {generation_tps:.1f} tokens/s")
        if stats is None:
            line += " (the engine did not answer EngineStats)"
        else:
            line += (f", Running: {stats.num_requests_running} reqs, "
                     f"Waiting: {stats.num_requests_waiting} reqs, "
                     f"GPU KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
                     f"Prefix cache hit rate: {100 * hit_rate:.1f}%")
        self.writer.write(line)
