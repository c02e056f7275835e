"""The resource base every store and HTTP summarizer shares: ``aclose()`` and ``async with``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self

__all__ = ["AsyncResource"]


class AsyncResource(ABC):
    """Something to close; ``async with`` it to close it on the way out."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release what the resource holds; closing twice is harmless."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
