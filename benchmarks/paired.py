"""Paired timing of two nexuskv installs, for the benchmark scripts beside this file.

Each install runs in a worker process of the calling script (started with ``--worker``, the
script's own line protocol: a configuration line, then "time" lines each answered with one
call's microseconds); the workers' calls alternate one by one, in turn order reversed every
round, so that a slow spell of a shared machine falls on both alike.  The speed-up is the
median of the per-pair ratios, which moves far less between runs than either median time.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys


class Worker:
    """``script --worker`` in a subprocess, importing nexuskv from `path` (None: the environment's)."""

    def __init__(self, script: str, path: str | None):
        env = dict(os.environ)
        if path:
            env["PYTHONPATH"] = path
        self.proc = subprocess.Popen(
            [sys.executable, script, "--worker"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def ask(self, line: str) -> str:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if not answer:
            raise RuntimeError(f"worker {self.proc.args} gave no answer to {line!r} (exit {self.proc.poll()})")
        return answer

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def paired_times(workers: list[Worker], config: str, reps: int) -> tuple[str, list[list[float]]]:
    """The first worker's answer to `config`, and reps single-call times per worker, alternating."""
    answers = [w.ask(config) for w in workers]
    times: list[list[float]] = [[] for _ in workers]
    for r in range(reps):
        order = range(len(workers)) if r % 2 == 0 else reversed(range(len(workers)))
        for i in order:
            times[i].append(float(workers[i].ask("time")))
    return answers[0], times


def paired_speedup(times: list[list[float]]) -> float:
    """Median over the pairs of baseline time / this install's time (times[1] / times[0])."""
    return statistics.median(b / a for a, b in zip(times[0], times[1]))
