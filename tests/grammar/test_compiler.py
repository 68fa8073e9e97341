"""GrammarCompilerCache: compile once per spec, readable errors, the model's vocabulary and EOS."""

from __future__ import annotations

import pytest
import xgrammar as xgr

from specd.grammar.backend import GrammarSpec
from specd.grammar.compiler import GrammarCompileError, GrammarCompilerCache
from specd.grammar.matcher import SequenceGrammar
from specd.messages import ConfigError

EOS_IDS = [1, 3]  # the tiny target's eos ids
VOCAB = 512


def test_same_spec_compiles_once(tokenizer):
    cache = GrammarCompilerCache(tokenizer, VOCAB, eos_token_ids=EOS_IDS)
    spec = GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
    first = cache.compile(spec)
    assert cache.compile(GrammarSpec(spec.kind, spec.source)) is first  # equal spec -> same entry
    cache.validate(spec)
    assert (cache.num_compiles, cache.num_hits, len(cache)) == (1, 2, 1)


def test_lru_is_bounded(tokenizer):
    cache = GrammarCompilerCache(tokenizer, VOCAB, eos_token_ids=EOS_IDS, max_entries=2)
    a, b, c = (GrammarSpec("regex", r) for r in ("a+", "b+", "c+"))
    cache.compile(a), cache.compile(b), cache.compile(a), cache.compile(c)  # b is least recent
    assert len(cache) == 2
    cache.compile(a)
    assert cache.num_compiles == 3
    cache.compile(b)
    assert cache.num_compiles == 4


@pytest.mark.parametrize("spec,words", [
    (GrammarSpec("json_schema", "{not json"), ["JSON schema is not valid JSON", "line 1 column 2"]),
    (GrammarSpec("json_schema", '{"type": "foo"}'), ["invalid JSON schema", 'Unsupported type "foo"']),
    (GrammarSpec("json_schema", "[1, 2]"), ["invalid JSON schema", "should be an object or bool"]),
    (GrammarSpec("json_schema", '{"$ref": "#/definitions/x"}'), ["invalid JSON schema", "definitions"]),
    (GrammarSpec("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), ["minimum greater"]),
    (GrammarSpec("json_schema", '{"type": "string", "pattern": "(("}'), ["invalid JSON schema", "parenthesis"]),
    (GrammarSpec("regex", "(ab"), ["invalid regex", "parenthesis is not closed"]),
    (GrammarSpec("regex", "(?<=a)b"), ["invalid regex", "Lookbehind is not supported"]),
    (GrammarSpec("regex", "a{2,1}"), ["invalid regex", "2 > 1"]),
    (GrammarSpec("ebnf", "root ::= foo"), ["invalid EBNF grammar", 'Rule "foo" is not defined']),
    (GrammarSpec("ebnf", 'start ::= "a"'), ["invalid EBNF grammar", '"root" is not found']),
    (GrammarSpec("yaml", "a: 1"), ["unknown grammar kind 'yaml'"]),
    (GrammarSpec("regex", r"[^\s\S]"), ["the regex allows no output at all"]),
])
def test_bad_grammars_raise_a_readable_compile_error(cache, spec, words):
    with pytest.raises(GrammarCompileError) as e:
        cache.validate(spec)
    message = str(e.value)
    assert isinstance(e.value, ConfigError) and message.startswith("response_format: ")
    assert "/project/cpp" not in message and "Check failed" not in message  # no C++ location
    for word in words:
        assert word in message, message


def test_config_errors_name_the_field(tokenizer):
    with pytest.raises(ConfigError, match="^vocab_size"):
        GrammarCompilerCache(tokenizer, 0, eos_token_ids=EOS_IDS)
    with pytest.raises(ConfigError, match="^eos_token_ids"):
        GrammarCompilerCache(tokenizer, VOCAB, eos_token_ids=[VOCAB])
    with pytest.raises(ConfigError, match="^max_entries"):
        GrammarCompilerCache(tokenizer, VOCAB, eos_token_ids=EOS_IDS, max_entries=0)


def test_default_eos_is_the_tokenizers(tokenizer):
    assert GrammarCompilerCache(tokenizer, VOCAB).eos_token_ids == [tokenizer.eos_token_id]


def test_from_model_dir_reads_vocab_and_eos(tiny_models):
    cache = GrammarCompilerCache.from_model_dir(tiny_models["target-llama"])
    assert (cache.vocab_size, cache.eos_token_ids, cache.bitmask_width) == (512, EOS_IDS, 16)


def _walk(grammar: SequenceGrammar, tokenizer, text: str, allowed_ids) -> list[list[int]]:
    """Commit text token by token; the allowed ids before each token and at the end."""
    rows = [allowed_ids(grammar.next_mask())]
    for token in tokenizer.encode(text, add_special_tokens=False):
        grammar.commit([token])
        rows.append(allowed_ids(grammar.next_mask()))
    return rows


def test_padded_model_vocab_masks_the_padding_ids(tokenizer, allowed_ids):
    """config vocab_size > len(tokenizer): ids past the tokenizer are never allowed."""
    cache = GrammarCompilerCache(tokenizer, 600, eos_token_ids=EOS_IDS)
    assert cache.bitmask_width == 19
    grammar = SequenceGrammar(cache.compile(GrammarSpec("json_object")))
    rows = _walk(grammar, tokenizer, allowed_ids=allowed_ids, text='{"a": "xyz", "b": [1, 2.5e3, null]}')
    assert all(max(r) < len(tokenizer) for r in rows)
    assert rows[-1] == EOS_IDS


def test_special_tokens_never_appear_inside_text_and_eos_ends_the_grammar(cache, tokenizer, allowed_ids):
    grammar = SequenceGrammar(cache.compile(GrammarSpec("regex", '"[^"]*"')))
    rows = _walk(grammar, tokenizer, '"abc', allowed_ids)
    inside = rows[-1]
    assert len(inside) > 300 and not set(inside) & {0, 1, 2, 3}  # <|begin_of_text|> etc. are not text
    assert _walk(grammar, tokenizer, '"', allowed_ids)[-1] == EOS_IDS  # complete: only EOS may follow
    grammar.commit([3])
    assert grammar.is_terminated()


def test_json_object_is_an_object(cache, tokenizer, allowed_ids):
    grammar = SequenceGrammar(cache.compile(GrammarSpec("json_object")))
    assert [tokenizer.decode([t]) for t in allowed_ids(grammar.next_mask())] == ["{"]


def test_xgrammar_cache_is_off_ours_is_the_bound(cache):
    assert isinstance(cache.tokenizer_info, xgr.TokenizerInfo)
    assert cache._compiler.get_cache_size_bytes() == 0


def test_schemas_xgrammar_only_approximates_are_refused(tokenizer):
    """xgrammar ignores minLength next to a pattern (with a warning on fd 2): refused by default,
    so no response can break the schema; reject_inexact=False keeps the approximation."""
    schema = '{"type": "string", "pattern": "^a+$", "minLength": 3}'
    strict = GrammarCompilerCache(tokenizer, VOCAB, eos_token_ids=EOS_IDS)
    with pytest.raises(GrammarCompileError, match="cannot enforce exactly: pattern combined with minLength"):
        strict.validate(GrammarSpec("json_schema", schema))
    with pytest.raises(GrammarCompileError, match="oneOf"):
        strict.validate(GrammarSpec("json_schema", '{"oneOf": [{"type": "integer"}, {"type": "number"}]}'))
    loose = GrammarCompilerCache(tokenizer, VOCAB, eos_token_ids=EOS_IDS, reject_inexact=False)
    loose.validate(GrammarSpec("json_schema", schema))
    strict.validate(GrammarSpec("json_schema", '{"type": "string", "pattern": "^a+$"}'))  # exact: fine
