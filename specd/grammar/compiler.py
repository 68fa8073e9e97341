"""GrammarSpec -> xgrammar CompiledGrammar, once per spec, for one model's vocabulary.

The token masks are as wide as the MODEL's vocabulary (config.json vocab_size, the lm_head rows),
which may exceed the tokenizer's: xgrammar treats the padding ids as special tokens and never
allows them. Every xgrammar failure on a user grammar becomes a GrammarCompileError here, in one
place, with xgrammar's explanation stripped of its C++ source location.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import xgrammar as xgr

from specd.grammar.allowed_rows import AllowedRows, VocabBytes
from specd.grammar.backend import GrammarSpec
from specd.grammar.budget import ClosingConfig
from specd.grammar.closing import ClosingPreference
from specd.grammar.errors import GrammarCompileError
from specd.grammar.calendar import exact_calendar_formats
from specd.grammar.schema_gaps import find_schema_gaps
from specd.messages import ConfigError

logger = logging.getLogger(__name__)

# json_object: any JSON object. strict_mode=False, or the empty property list would allow only {}.
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
_KIND_NOUNS = {"json_schema": "JSON schema", "json_object": "JSON object grammar",
               "regex": "regex", "ebnf": "EBNF grammar", "structural_tag": "structural tag"}
# "[15:53:06] /project/cpp/regex_converter.cc:94: " and "Check failed: (error.empty()) is false: "
_CPP_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false:\s*")
_MAX_DETAIL_CHARS = 400


def default_max_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def build_tokenizer_info(tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with the tokenizer's special tokens made unreachable.

    xgrammar decodes a byte-level vocabulary literally, so an added special token such as
    <|im_start|> would count as the text "<|im_start|>" and could appear inside a JSON string;
    blanking those entries makes xgrammar treat them as special (never allowed). The eos ids stay
    the stop tokens: the only tokens allowed once the grammar is complete.
    """
    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=list(eos_token_ids))
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    special.update(i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                   if getattr(t, "special", False))
    special = {i for i in special if 0 <= i < vocab_size}
    if not special:
        return base
    encoded_vocab = [""] * vocab_size  # as from_huggingface builds it: id -> encoded token text
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size and i not in special:
            encoded_vocab[i] = token
    return xgr.TokenizerInfo(encoded_vocab, base.vocab_type, vocab_size=vocab_size,
                             stop_token_ids=list(eos_token_ids), add_prefix_space=base.add_prefix_space)


def json_depth(value) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in children)
    return depth


def _xgrammar_detail(e: BaseException) -> str:
    lines = [_CHECK_FAILED.sub("", _CPP_PREFIX.sub("", line)).strip() for line in str(e).splitlines()]
    detail = " ".join(line for line in lines if line) or type(e).__name__
    return detail if len(detail) <= _MAX_DETAIL_CHARS else detail[:_MAX_DETAIL_CHARS] + "..."


class GrammarCompilerCache:
    """Compiles GrammarSpecs for one tokenizer + model vocabulary; keeps the last max_entries.

    Thread-safe: the grammar service compiles from several RPC threads (JSON-schema compiles
    serialise on reading xgrammar's warnings from fd 2). Two threads compiling the
    same new spec at once may both compile it (compiling under the lock would serialise all
    compiles behind a slow schema).
    """

    def __init__(self, tokenizer, vocab_size: int, *, eos_token_ids: Sequence[int] | int | None = None,
                 max_entries: int = 256, max_threads: int | None = None,
                 max_schema_depth: int = 128, reject_inexact: bool = True,
                 closing: ClosingConfig | None = ClosingConfig()) -> None:
        # closing: how rows near the end of a budget are shaped (specd/grammar/budget.py); None:
        # never (a budget then ends constrained output mid-value, finish_reason "length").
        # reject_inexact: a schema xgrammar can only approximate (it ignores a keyword, or reads
        # oneOf as anyOf) is refused, so every constrained response validates against its schema.
        self.reject_inexact = reject_inexact
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        if eos_token_ids is None or len(eos_token_ids) == 0:
            eos = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = [] if eos is None else [eos]
        max_threads = default_max_threads() if max_threads is None else max_threads
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ConfigError(f"vocab_size: must be a positive integer, got {vocab_size!r}")
        if not eos_token_ids:
            raise ConfigError("eos_token_ids: none given and the tokenizer has no eos_token_id")
        bad = [i for i in eos_token_ids if not isinstance(i, int) or not 0 <= i < vocab_size]
        if bad:
            raise ConfigError(f"eos_token_ids: {bad} outside the vocabulary [0, {vocab_size})")
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ConfigError(f"max_entries: must be >= 1, got {max_entries!r}")
        if not isinstance(max_threads, int) or max_threads < 1:
            raise ConfigError(f"max_threads: must be >= 1, got {max_threads!r}")
        if not isinstance(max_schema_depth, int) or max_schema_depth < 1:
            raise ConfigError(f"max_schema_depth: must be >= 1, got {max_schema_depth!r}")
        self.max_schema_depth = max_schema_depth
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.max_entries = max_entries
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, self.eos_token_ids)
        # xgrammar's own cache is unbounded by default; ours is the one bounded LRU.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads,
                                             cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._vocab_bytes: VocabBytes | None = None  # built on first use (allowed_rows)
        self._allowed_rows: dict[bool, AllowedRows] = {}  # is a JSON kind -> its rows
        self._closing_preference = None  # built on first use (closing_preference)
        if closing is not None and not isinstance(closing, ClosingConfig):
            raise ConfigError(f"closing: expected a ClosingConfig or None, got {type(closing).__name__}")
        self.closing = closing
        self.num_compiles = 0  # specs compiled successfully (cache misses that succeeded)
        self.num_hits = 0

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, **kwargs) -> "GrammarCompilerCache":
        """Tokenizer, vocab_size (config.json) and eos ids (generation_config.json, else config.json)."""
        from specd.models.hf_config import read_json
        from specd.models.loader import load_tokenizer

        model_dir = Path(model_dir)
        config = read_json(model_dir / "config.json")
        vocab_size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
        gen_path = model_dir / "generation_config.json"
        eos = (read_json(gen_path) if gen_path.is_file() else {}).get("eos_token_id")
        eos = config.get("eos_token_id") if eos is None else eos
        if "eos_token_ids" not in kwargs and eos is not None:
            kwargs["eos_token_ids"] = [eos] if isinstance(eos, int) else list(eos)
        return cls(load_tokenizer(model_dir), vocab_size, **kwargs)

    @property
    def bitmask_width(self) -> int:
        """int32 words per bitmask row: ceil(vocab_size / 32)."""
        return (self.vocab_size + 31) // 32

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of spec (cached); GrammarCompileError when it cannot compile."""
        if not isinstance(spec, GrammarSpec):
            raise ConfigError(f"grammar: expected a GrammarSpec, got {type(spec).__name__}")
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                self.num_hits += 1
                return compiled
        compiled = self._compile_uncached(spec)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            self.num_compiles += 1
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return compiled

    def sequence_grammar(self, spec: GrammarSpec) -> "SequenceGrammar":
        """A fresh matcher for one sequence, with the token rows its grammar kind needs."""
        from specd.grammar.matcher import SequenceGrammar

        return SequenceGrammar(self.compile(spec), self.allowed_rows(spec.kind), closing=self.closing,
                               closing_preference=self.closing_preference)

    def closing_preference(self) -> ClosingPreference:
        """The closing walk's token order for this vocabulary (built on first use, then shared)."""
        if self._closing_preference is None:
            self._closing_preference = ClosingPreference.from_tokenizer_info(self.tokenizer_info)
        return self._closing_preference

    def allowed_rows(self, kind: str) -> AllowedRows:
        """The rows ANDed into every mask of a grammar of this kind (allowed_rows.py): no encoded
        UTF-16 surrogates for every kind; JSON kinds also no raw control characters (our JSON
        grammars use compact separators, so no valid output holds one, while xgrammar's
        bounded-string rule admits them: issue #800). Built on first use, then shared."""
        is_json = kind in ("json_schema", "json_object")
        with self._lock:
            if is_json not in self._allowed_rows:
                if self._vocab_bytes is None:
                    info = self.tokenizer_info
                    self._vocab_bytes = VocabBytes.from_vocab(info.decoded_vocab, info.special_token_ids,
                                                              self.vocab_size)
                self._allowed_rows[is_json] = self._vocab_bytes.allowed_rows(mask_control_characters=is_json)
            return self._allowed_rows[is_json]

    def validate(self, spec: GrammarSpec) -> None:
        """Compile spec (warming the cache) or raise GrammarCompileError."""
        self.compile(spec)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    def _check_schema_text(self, source: str) -> None:
        """Valid JSON, nested at most max_schema_depth levels.

        Python's parse error names line and column (xgrammar's echoes the whole text). The depth
        bound is there because xgrammar's compile time grows steeply with nesting (a schema of
        ~1,000 levels takes seconds, ~3,000 over a minute) and cannot be interrupted; real schemas
        nest ~5-20 levels.
        """
        try:
            depth = json_depth(json.loads(source))
        except json.JSONDecodeError as e:
            raise GrammarCompileError(f"response_format: the JSON schema is not valid JSON: {e}") from None
        except RecursionError:  # deeper than Python's own parser goes
            depth = None
        if depth is None or depth > self.max_schema_depth:
            raise GrammarCompileError(f"response_format: the JSON schema nests deeper than "
                                      f"{self.max_schema_depth} levels (max_schema_depth)")

    def _compile_uncached(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        noun = _KIND_NOUNS.get(spec.kind)
        if noun is None:
            raise GrammarCompileError(f"response_format: unknown grammar kind {spec.kind!r}; "
                                      f"expected one of {', '.join(_KIND_NOUNS)}")
        if spec.kind == "json_schema":
            self._check_schema_text(spec.source)
        try:
            compiled = self._compile_with_xgrammar(spec)
            accepts_nothing = not self._first_mask_allows_a_token(compiled)
        except GrammarCompileError:
            raise
        # xgrammar reports a bad grammar as RuntimeError (InvalidJSONError is one), ValueError or
        # TypeError from its C++ checks; any of them is the user's grammar, never a server crash.
        except Exception as e:  # noqa: BLE001 - the one place xgrammar's errors are translated
            logger.debug("xgrammar rejected a %s", spec.kind, exc_info=True)
            raise GrammarCompileError(f"response_format: invalid {noun}: {_xgrammar_detail(e)}") from None
        if accepts_nothing:  # an all-zero mask would make every logit -inf (NaN probabilities)
            raise GrammarCompileError(f"response_format: the {noun} allows no output at all")
        return compiled

    def _compile_with_xgrammar(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json_schema":
            return self._compiler.compile_grammar(self._json_schema_grammar(spec.source))
        if spec.kind == "structural_tag":
            return self._compiler.compile_structural_tag(self._exact_structural_tag(spec.source))
        if spec.kind == "json_object":
            return self._compiler.compile_json_schema(_JSON_OBJECT_SCHEMA, any_whitespace=False,
                                                      strict_mode=False)
        if spec.kind == "regex":
            return self._compiler.compile_regex(spec.source)
        return self._compiler.compile_grammar(spec.source)

    def _json_schema_grammar(self, source: str) -> xgr.Grammar:
        """A JSON schema's grammar, or GrammarCompileError where xgrammar could only approximate it.

        Separators ", " and ": " and no free whitespace: free whitespace lets weak models loop on
        spaces. Dates as calendar-exact patterns: xgrammar's own admit 2023-02-31 (calendar.py).
        """
        grammar, warnings = _with_native_warnings(lambda: xgr.Grammar.from_json_schema(
            exact_calendar_formats(source), any_whitespace=False, strict_mode=True))
        # xgrammar's bounded string (maxLength) admits raw control characters (its issue #800),
        # which strict JSON refuses: the same character class as its other strings.
        text = str(grammar)
        if _BOUNDED_STRING_CHARS in text:
            grammar = xgr.Grammar.from_ebnf(text.replace(_BOUNDED_STRING_CHARS, _STRING_CHARS))
        inexact = list(dict.fromkeys(w for w in warnings if any(m in w for m in _INEXACT_MARKERS)))
        # What xgrammar gets wrong without a warning (schema_gaps.py); the source is valid JSON.
        inexact += find_schema_gaps(json.loads(source))
        if inexact and self.reject_inexact:
            more = f" (and {len(inexact) - 1} more)" if len(inexact) > 1 else ""
            raise GrammarCompileError(f"response_format: the JSON schema uses a feature the grammar "
                                      f"engine cannot enforce exactly: {inexact[0]}{more}")
        for w in warnings:
            logger.warning("xgrammar: %s", w)
        return grammar

    def _exact_structural_tag(self, source: str) -> str:
        """The structural tag with each JSON-schema format replaced by the grammar a json_schema
        response_format gets (_json_schema_grammar), so a tool's arguments follow the same rules."""
        try:
            tag = json.loads(source)
        except (json.JSONDecodeError, RecursionError):
            raise GrammarCompileError("response_format: the structural tag is not valid JSON") from None
        if json_depth(tag) > self.max_schema_depth + 8:
            raise GrammarCompileError(f"response_format: the structural tag nests deeper than "
                                      f"{self.max_schema_depth} levels (max_schema_depth)")
        stack = [tag]
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                stack.extend(node)
            elif isinstance(node, dict):
                if node.get("type") == "json_schema" and "json_schema" in node:
                    schema = json.dumps(node["json_schema"], ensure_ascii=False)
                    node.clear()
                    node.update(type="grammar", grammar=str(self._json_schema_grammar(schema)))
                else:
                    stack.extend(node.values())
        return json.dumps(tag, ensure_ascii=False)

    def _first_mask_allows_a_token(self, compiled: xgr.CompiledGrammar) -> bool:
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        num_tail_bits = self.vocab_size % 32  # xgrammar may set the bits of ids >= vocab_size
        if num_tail_bits:
            bitmask[0, -1] &= (1 << num_tail_bits) - 1
        return bool(bitmask.any())


# xgrammar's words when it compiles a schema only approximately (it warns on stderr and goes on).
_INEXACT_MARKERS = ("not supported", "ignoring", "ignored", "cannot be represented exactly",
                    "still ongoing", "not yet supported")
_BOUNDED_STRING_CHARS = r'[^\"\\\r\n]'  # as str(Grammar) writes them
_STRING_CHARS = r'[^\0-\x1f\"\\\r\n]'
_STDERR_LOCK = threading.Lock()  # fd 2 is process-wide: one capture at a time


def _with_native_warnings(compile_fn):
    """Run compile_fn with the process's fd 2 captured; returns (result, xgrammar warning lines).

    xgrammar reports unsupported schema keywords only as C++ log lines on stderr, so they are read
    back from the file descriptor itself (Python's sys.stderr never sees them).
    """
    with _STDERR_LOCK, tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            result = compile_fn()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        text = captured.read().decode(errors="replace")
    lines = [re.sub(r"^\[[^\]]*\] \S+: (Warning: )?", "", line) for line in text.splitlines() if line.strip()]
    return result, lines
