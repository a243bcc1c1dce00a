"""A MetricsLogger stand-in for step-loop tests: keeps the records in a list."""

from __future__ import annotations


class Logger:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        self.records.append(record)

    def log_samples(self, samples: dict) -> None:
        pass

    def finish(self, exit_code: int) -> None:
        pass
