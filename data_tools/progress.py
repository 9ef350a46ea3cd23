"""Progress with documents/s, MB/s and tokens/s: a tqdm bar on a terminal, plain lines
every few seconds otherwise (logs, CI), and a summary line at the end either way."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(
        self,
        total_documents: int,
        description: str,
        stream: TextIO | None = None,
        interval_s: float = 5.0,
        enabled: bool = True,
    ) -> None:
        self.stream = stream or sys.stderr
        self.description = description
        self.total = total_documents
        self.interval_s = interval_s
        self.enabled = enabled
        self.documents = self.bytes = self.tokens = 0
        self.start = self._last_line = time.perf_counter()
        self._bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_documents,
                desc=description,
                unit="doc",
                file=self.stream,
                dynamic_ncols=True,
                smoothing=0.1,
            )

    @property
    def elapsed(self) -> float:
        return max(time.perf_counter() - self.start, 1e-9)

    def rates(self) -> str:
        seconds = self.elapsed
        return (
            f"{self.documents / seconds:,.0f} docs/s, {self.bytes / seconds / 1e6:,.2f} MB/s, "
            f"{self.tokens / seconds:,.0f} tokens/s"
        )

    def update(self, documents: int, nbytes: int, tokens: int) -> None:
        self.documents += documents
        self.bytes += nbytes
        self.tokens += tokens
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(documents)
            seconds = self.elapsed
            self._bar.set_postfix_str(
                f"{self.bytes / seconds / 1e6:.2f} MB/s, {self.tokens / seconds:,.0f} tok/s",
                refresh=False,
            )
        elif time.perf_counter() - self._last_line >= self.interval_s:
            self._last_line = time.perf_counter()
            share = f" ({100 * self.documents / self.total:.0f}%)" if self.total else ""
            print(
                f"{self.description}: {self.documents:,}/{self.total:,} documents{share}, "
                + self.rates(),
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self.enabled:
            print(
                f"{self.description}: {self.documents:,} documents, {self.bytes / 1e6:,.2f} MB, "
                f"{self.tokens:,} tokens in {self.elapsed:.1f} s ({self.rates()})",
                file=self.stream,
                flush=True,
            )
