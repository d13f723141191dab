"""Streaming helpers over the generation functions' `on_tokens` callback.

`generate(..., on_tokens=f)` and `generate_autoregressive(..., on_tokens=f)` call f in the
caller's thread with each row's newly committed tokens (`generation.stream_chunks`). Here:

* `TokenStream`: the same as an iterator (like Hugging Face's TextIteratorStreamer): the
  generation runs in a background thread and the iteration yields its chunks.
* `TextDecoder`: token ids in, text out, one chunk at a time: decodes everything so far and
  returns what is new, holding back replacement characters at the end (a token that is half of
  a UTF-8 sequence decodes to U+FFFD until the next one completes it).

    from qspec_jax.streaming import TextDecoder, TokenStream
    stream = TokenStream(generate, model, [ids], SpecConfig(max_new_tokens=64))
    text = TextDecoder(model.decode)
    for chunk in stream:                  # one list of new token ids per prompt
        print(text.push(chunk[0]), end="", flush=True)
    result = stream.result                # the SpecResult, as generate returns it
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

_DONE = object()


class TokenStream:
    """Iterates over the token chunks of `fn(*args, on_tokens=..., **kwargs)` (a generation
    function) run in a background thread; `result` is fn's return value once the iteration has
    ended. An exception raised by fn is raised by the iteration. Iterate once."""

    def __init__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._result: Any = None
        self._error: BaseException | None = None
        self._finished = False

        def work() -> None:
            try:
                self._result = fn(*args, on_tokens=self._queue.put, **kwargs)
            except BaseException as e:  # handed to the iterating thread
                self._error = e
            finally:
                self._queue.put(_DONE)

        self._thread = threading.Thread(target=work, name="qspec-generate", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator[list[list[int]]]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                break
            yield item
        self._thread.join()
        self._finished = True
        if self._error is not None:
            raise self._error

    @property
    def result(self) -> Any:
        """The generation's result (available after the iteration ended)."""
        if not self._finished:
            raise RuntimeError("TokenStream.result: iterate over the stream to its end first")
        return self._result


class TextDecoder:
    """Incremental detokenization of one sequence: `push(ids)` returns the text the new ids add.

    `decode(ids) -> str` is the tokenizer's decode (e.g. `model.decode`). Decoding the whole
    sequence each time (not token by token) keeps the spaces and merged characters that
    tokenizers produce only in context. Replacement characters (U+FFFD) at the end of the text
    are held back: they stand for an incomplete UTF-8 sequence until a later token completes
    it (or shows it invalid, when text follows them); `flush()` returns whatever is held back.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._printed = 0  # characters of decode(ids) already returned

    def push(self, ids: list[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        return self._take(self._decode(self._ids).rstrip("\ufffd"))

    def flush(self) -> str:
        return self._take(self._decode(self._ids))

    @property
    def text(self) -> str:
        """Everything returned so far."""
        return self._decode(self._ids)[: self._printed]

    def _take(self, text: str) -> str:
        new = text[self._printed:]
        self._printed = max(self._printed, len(text))
        return new
