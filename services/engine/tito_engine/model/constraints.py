"""Structured outputs: the constraint of a request, its compilation, and the per-step token masks.

Built on xgrammar (bench/grammar_libraries.py compares it with llguidance and outlines_core; the
engine README gives the figures and the reasons). Three stages, three places:

- `validate` (tito/structured_output.py; admission, server process, no tokenizer): builds the
  constraint's grammar, which checks the schema / regex / grammar; a mistake is INVALID_ARGUMENT
  with xgrammar's message, reason INVALID_STRUCTURED_OUTPUT and the field, before the request is
  queued. Both backends.
- `GrammarCompiler` (engine core): compiles the grammar against the model's vocabulary in a
  worker thread, off the step loop, and caches the compiled grammar by the constraint's hash.
- `TokenMasks` (scheduler step): one bitmask apply for all the constrained rows of a step, then
  each matcher takes its sampled token and a worker thread computes the next masks of the
  batch in one call while the engine runs on. A step without a constrained row never gets here.

A compiled grammar and its matchers are native objects that do not pickle: only the
`StructuredOutputSpec` (plain strings) crosses from the server to the core process.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

from tito.errors import FailedPrecondition, InvalidArgument
from tito.structured_output import (INVALID_STRUCTURED_OUTPUT, StructuredOutputSpec, compiler_message, grammar_of,
                                    validate)

log = logging.getLogger(__name__)

__all__ = ["GrammarCompiler", "INVALID_STRUCTURED_OUTPUT", "StructuredOutputSpec", "TokenMasks", "compile_error",
           "new_matcher", "validate"]


class GrammarCompiler:
    """Compiles constraints against the model's vocabulary in worker threads, cached by hash.

    Lives in the engine core. The tokenizer is read from the model directory on the first
    constrained request (a model without tokenizer files refuses constrained requests with
    FAILED_PRECONDITION). The cache keeps the `cache_size` most recently used grammars.
    """

    def __init__(self, model_dir: Path | str | None, vocab_size: int, stop_token_ids: Sequence[int],
                 threads: int = 1, cache_size: int = 256):
        self._model_dir = model_dir
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tito-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        self._cache_size = cache_size
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built by the first compile
        self._compiler_lock = threading.Lock()

    def submit(self, spec: StructuredOutputSpec) -> concurrent.futures.Future:
        """A future of the compiled grammar (done at once on a cache hit)."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile(self, spec: StructuredOutputSpec) -> Any:
        grammar = grammar_of(spec)  # admission validated it; a failure here is still the caller's
        return self._xgrammar_compiler().compile_grammar(grammar)

    def _xgrammar_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._build_compiler()
            return self._compiler

    def _build_compiler(self) -> Any:
        """Reads the tokenizer (seconds for a large vocabulary): once per engine."""
        import xgrammar
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(self._model_dir))
        except Exception as exc:  # noqa: BLE001 - any loader error means the same thing here
            raise FailedPrecondition(
                f"structured outputs need the model's tokenizer, which could not be loaded from the model "
                f"directory ({type(exc).__name__}); send the request without structured_output",
                reason="STRUCTURED_OUTPUT_UNAVAILABLE", field="sampling_params.structured_output") from None
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self._vocab_size,
                                                       stop_token_ids=self._stop_token_ids)
        return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def compile_error(exc: BaseException, spec: StructuredOutputSpec) -> Exception:
    """The caller-facing error for a compile that failed in the core."""
    if isinstance(exc, (InvalidArgument, FailedPrecondition)):
        return exc
    return InvalidArgument(f"invalid {spec.kind} constraint: {compiler_message(exc)}",
                           reason=INVALID_STRUCTURED_OUTPUT, field=spec.field)


def new_matcher(compiled: Any, prior_output: Sequence[int] = ()) -> Any:
    """A matcher (one per choice) at the start of the compiled grammar, or past `prior_output`:
    the ids a migrated choice already generated under the same grammar on another engine, so the
    continuation is constrained exactly where the first engine stopped. Ids the grammar refuses,
    or that already complete it, are INVALID_ARGUMENT (they are not that grammar's output)."""
    import xgrammar

    matcher = xgrammar.GrammarMatcher(compiled)
    for position, token in enumerate(prior_output):
        if matcher.is_terminated() or not matcher.accept_token(token):
            raise InvalidArgument(f"the choice's earlier output (prior_output_tokens) does not follow "
                                  f"structured_output: its grammar refuses token {token} at output position "
                                  f"{position}", reason="INVALID_SAMPLING_PARAMS",
                                  field="sampling_params.prior_output_tokens")
    if matcher.is_terminated():
        raise InvalidArgument("the choice's earlier output (prior_output_tokens) already completes its "
                              "structured_output: nothing is left to generate", reason="INVALID_SAMPLING_PARAMS",
                              field="sampling_params.prior_output_tokens")
    return matcher


class TokenMasks:
    """The step's hook: mask the constrained rows' logits, then advance their matchers.

    After a step advances its matchers, a worker thread computes their next masks at once
    (xgrammar releases the GIL), while the engine sends the step's outputs and runs the next
    forward; the next `apply` only copies those rows into place. A matcher with no mask ready
    (a choice that just started, or one that sat out a step) is filled then, in the same batch.
    """

    def __init__(self, vocab_size: int):
        import xgrammar

        self._xgrammar = xgrammar
        self._vocab_size = vocab_size
        self._batch = xgrammar.BatchGrammarMatcher(max_threads=1)
        self._step_mask = xgrammar.allocate_token_bitmask(64, vocab_size)  # by logits row
        self._ahead_mask = xgrammar.allocate_token_bitmask(64, vocab_size)  # by position in _ahead_matchers
        self._ahead_matchers: list[Any] = []  # kept referenced: their ids key _ahead_rows
        self._ahead_rows: dict[int, int] = {}
        self._ahead: concurrent.futures.Future | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tito-masks")
        import torch

        self._bit_shifts = torch.arange(32, dtype=torch.int32)  # bit j of a mask word: token 32 * word + j

    def apply(self, logits: Any, rows: list[int], matchers: list[Any]) -> None:
        """In place: every token the matcher of row rows[j] cannot take gets -inf (one fill of the
        missing masks, one apply for all rows)."""
        if logits.shape[0] > self._step_mask.shape[0]:
            self._step_mask = self._xgrammar.allocate_token_bitmask(logits.shape[0] * 2, self._vocab_size)
        ready = self._take_ahead()
        source, target, missing, missing_rows = [], [], [], []
        for row, matcher in zip(rows, matchers):
            position = ready.get(id(matcher))
            if position is None:
                missing.append(matcher)
                missing_rows.append(row)
            else:
                source.append(position)
                target.append(row)
        if not missing and source == target == list(range(logits.shape[0])):
            bitmask = self._ahead_mask  # the usual step: the same rows in the same order, no copy
        else:
            bitmask = self._step_mask
            if source:
                bitmask[target] = self._ahead_mask[source]
            if missing:
                self._batch.batch_fill_next_token_bitmask(missing, bitmask, missing_rows)
        if logits.device.type == "cpu":
            self._apply_on_cpu(logits, bitmask, rows)
            return
        bitmask = bitmask[:logits.shape[0]].to(logits.device, non_blocking=True)
        self._xgrammar.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self._vocab_size, indices=rows)

    def _apply_on_cpu(self, logits: Any, bitmask: Any, rows: list[int]) -> None:
        """The bitmask unpacked and applied with three torch operations: on CPU about 5x faster
        than xgrammar's CPU kernel at batch 32 (whose per-call cost dominates small vocabularies)."""
        import torch

        every_row = rows == list(range(logits.shape[0]))
        with torch.inference_mode():  # the forward's logits are inference tensors
            target = logits if every_row else logits[rows]
            masks = bitmask[:logits.shape[0]] if every_row else bitmask[rows]
            allowed = (masks[:, :, None] >> self._bit_shifts) & 1
            target.masked_fill_(allowed.view(target.shape[0], -1)[:, :target.shape[1]] == 0, float("-inf"))
            if not every_row:
                logits[torch.tensor(rows)] = target

    def advance(self, matchers: list[Any], tokens: list[int]) -> list[bool]:
        """Feed each matcher its row's sampled token; True where the structure is now complete.
        Then start computing the next masks of the others."""
        done = []
        # One accept_token per row: xgrammar's batch_accept_token returns its results through a
        # container read item by item, which costs more than the 32 calls it replaces.
        for matcher, token in zip(matchers, tokens):
            if not matcher.accept_token(token):
                # Only an all-masked row can sample a refused token; end it rather than emit garbage.
                log.warning("a constrained row sampled token %d, which its grammar refuses; ending it", token)
                done.append(True)
                continue
            done.append(matcher.is_terminated())
        self._compute_ahead([matcher for matcher, finished in zip(matchers, done) if not finished])
        return done

    def _compute_ahead(self, matchers: list[Any]) -> None:
        self._take_ahead()  # never two fills of the buffer at once
        if len(matchers) > self._ahead_mask.shape[0]:
            self._ahead_mask = self._xgrammar.allocate_token_bitmask(len(matchers) * 2, self._vocab_size)
        self._ahead_matchers = matchers
        self._ahead_rows = {id(matcher): position for position, matcher in enumerate(matchers)}
        if matchers:
            self._ahead = self._pool.submit(self._batch.batch_fill_next_token_bitmask, matchers, self._ahead_mask)

    def _take_ahead(self) -> dict[int, int]:
        """Wait for the masks computed ahead; their rows by matcher id (valid until the next advance)."""
        if self._ahead is not None:
            try:
                self._ahead.result()
            except Exception:  # noqa: BLE001 - computed again, synchronously, by apply
                log.exception("computing token masks ahead failed")
                self._ahead_rows = {}
            self._ahead = None
        return self._ahead_rows
