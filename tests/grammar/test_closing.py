"""The closing walk (specd/grammar/closing.py) on real grammars and tokenizers, and its preference."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from specd.grammar.backend import GrammarSpec
from specd.grammar.closing import ClosingPreference, closing_suffix
from specd.grammar.masking import bitmask_to_bool, bool_to_bitmask

from tests.conftest import REPO
from tests.grammar.conftest import EOS_IDS

TRAINED = REPO / "models" / "specd-py-target"
SCHEMAS = ["Github_easy/o10298.json", "Glaiveai2K/calculate_area_092f0b0f.json",
           "Glaiveai2K/analyze_health_data_4ad104b4.json", "Github_easy/o27713.json", "Github_trivial/o34210.json"]


@pytest.fixture(scope="module")
def trained():
    """The trained target's compiler cache and tokenizer (byte-level BPE of 8,192 tokens)."""
    from specd.grammar.compiler import GrammarCompilerCache
    from specd.models.loader import load_tokenizer

    return GrammarCompilerCache.from_model_dir(TRAINED, reject_inexact=False), load_tokenizer(TRAINED)


def random_prefix(grammar, rng: random.Random, num_tokens: int) -> list[int]:
    """Commit up to num_tokens random allowed tokens (never a stop token); returns them."""
    tokens = []
    for _ in range(num_tokens):
        allowed = bitmask_to_bool(grammar.next_mask()[None], grammar.vocab_size)[0]
        allowed[EOS_IDS] = False
        if not allowed.any():
            break
        tokens.append(rng.choice(allowed.nonzero().flatten().tolist()))
        grammar.commit(tokens[-1:])
    return tokens


@pytest.mark.parametrize("name", SCHEMAS)
def test_walk_closes_real_schemas_from_mid_output_states(trained, load_schema, name):
    cache, tokenizer = trained
    schema = load_schema(name)
    spec = GrammarSpec("json_schema", json.dumps(schema))
    rng = random.Random(0)
    lengths = []
    for num_tokens in (0, 1, 2, 3, 5, 8, 13, 21, 34):
        grammar = cache.sequence_grammar(spec)
        prefix = random_prefix(grammar, rng, num_tokens)
        suffix = closing_suffix(grammar.fork_drafts(), cache.closing_preference(), 128)
        assert suffix is not None, (name, tokenizer.decode(prefix))
        assert suffix[-1] in EOS_IDS and not any(t in EOS_IDS for t in suffix[:-1])
        assert closing_suffix(grammar.fork_drafts(), cache.closing_preference(), 128) == suffix  # deterministic
        text = tokenizer.decode(prefix + suffix, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), schema)
        lengths.append(len(suffix))
    print(f"\n{name}: closing suffix lengths {lengths}")


def test_walk_returns_none_when_the_bound_is_too_small(trained, load_schema):
    cache, _ = trained
    grammar = cache.sequence_grammar(GrammarSpec("json_schema", json.dumps(load_schema(SCHEMAS[1]))))
    suffix = closing_suffix(grammar.fork_drafts(), cache.closing_preference(), 200)
    assert len(suffix) > 5
    assert closing_suffix(grammar.fork_drafts(), cache.closing_preference(), len(suffix) - 1) is None
    assert closing_suffix(grammar.fork_drafts(), cache.closing_preference(), len(suffix)) == suffix


def test_the_walk_from_along_a_suffix_is_the_rest_of_it(trained, load_schema):
    """What makes caching the suffix (and speculation) exact: each pick depends on the state only."""
    cache, _ = trained
    grammar = cache.sequence_grammar(GrammarSpec("json_schema", json.dumps(load_schema(SCHEMAS[2]))))
    random_prefix(grammar, random.Random(3), 6)
    suffix = closing_suffix(grammar.fork_drafts(), cache.closing_preference(), 200)
    for i in range(len(suffix) - 1):
        grammar.commit(suffix[i:i + 1])
        assert closing_suffix(grammar.fork_drafts(), cache.closing_preference(), 200) == suffix[i + 1:]


@pytest.mark.parametrize("kind,source,check", [
    ("regex", r"(yes|no|maybe)( [0-9]{1,3})?", None),
    ("regex", r"[a-z]+@[a-z]+\.(com|org)", None),  # the walk must leave the letter loops
    ("regex", r"[0-9]+#[A-Za-z0-9]+", None),
    ("regex", r"( |\t)*x( )*", None),  # whitespace loops
    ("ebnf", 'root ::= "[" item ("," item)* "]"\nitem ::= [a-z]+ | [0-9]+', r"\[([a-z]+|[0-9]+)(,([a-z]+|[0-9]+))*\]"),
])
def test_walk_closes_regexes_and_ebnf(cache, tokenizer, kind, source, check):
    spec = GrammarSpec(kind, source)
    rng = random.Random(1)
    for num_tokens in (0, 1, 2, 4, 7):
        grammar = cache.sequence_grammar(spec)
        prefix = random_prefix(grammar, rng, num_tokens)
        if grammar.is_terminated():
            continue
        suffix = closing_suffix(grammar.fork_drafts(), cache.closing_preference(), 64)
        assert suffix is not None and suffix[-1] in EOS_IDS, (source, tokenizer.decode(prefix))
        text = tokenizer.decode(prefix + suffix, skip_special_tokens=True)
        assert re.fullmatch(check or source, text), (source, text)


def test_preference_order(cache):
    """Stop tokens, then closing characters (outside a string `}`/`]` first, inside `"` first)."""
    pref = cache.closing_preference()
    vocab = cache.tokenizer_info.decoded_vocab
    order = torch.argsort(pref.rank)[:7].tolist()
    assert order[:2] == EOS_IDS
    assert [vocab[i] for i in order[2:7]] == [b"}", b"]", b'""', b'"', b'"""']
    order = torch.argsort(pref.rank_in_string)[:7].tolist()
    assert [vocab[i] for i in order[2:7]] == [b'"""', b'""', b'"', b"}", b"]"]
    space = vocab.index(b" ")
    letters = [vocab.index(c) for c in (b"a", b"b", b"Z")]
    assert pref.rank[letters[0]] < pref.rank[letters[1]] and pref.rank[vocab.index(b"1")] < pref.rank[vocab.index(b"0")]
    assert all(pref.rank[space] > pref.rank[t] for t in letters)  # whitespace after every other token


def test_ranked_is_the_reference_order_of_allowed_tokens(cache):
    pref = cache.closing_preference()
    gen = torch.Generator().manual_seed(0)
    for density in (0.002, 0.05, 0.5):
        allowed = torch.rand(3, 512, generator=gen) < density
        allowed[:, 0] = True  # never empty
        for row_allowed, row in zip(allowed, bool_to_bitmask(allowed)):
            rank = pref.rank_in_string if pref.in_string(row) else pref.rank
            want = sorted(row_allowed.nonzero().flatten().tolist(), key=lambda t: int(rank[t]))
            assert pref.ranked(row, 10) == want[:10]
            assert pref.best(row) == want[0]


def test_risky_rows_mark_structure_opening_tokens(cache):
    """Outside a string any token with `"` may open one; inside, `"` and `"}` close it."""
    pref = cache.closing_preference()
    vocab = cache.tokenizer_info.decoded_vocab
    risky = bitmask_to_bool(torch.stack([pref.risky_row, pref.risky_in_string_row]), 512)
    for i, text in enumerate(vocab):
        opens = bool(set(text) & set(b'",{[:')) and i not in (0, 1, 2, 3)
        assert bool(risky[0, i]) == opens, text
        assert bool(risky[1, i]) == (b'"' in text and not set(text) <= set(b'"}]')), text


def test_from_vocab_on_a_hand_made_vocabulary():
    vocab = [b"", b'"', b"}", b'"}', b"a", b"  ", b"1", b"null", b"ab"]
    pref = ClosingPreference.from_vocab(vocab, stop_token_ids=[0], special_token_ids=[], vocab_size=9)
    assert torch.argsort(pref.rank)[:9].tolist() == [0, 2, 1, 3, 7, 6, 4, 8, 5]
    assert pref.by_text[b"ab"] == 8 and pref.max_token_bytes == 4
    assert pref.closers == {0, 2} and pref.string_closers == {0, 1, 3}


@pytest.fixture(scope="module")
def qwen_cache(tiny_models):
    """The tiny Qwen3.5 target's compiler cache: a byte-level vocabulary of 512 tokens, so the walk
    spells nearly everything one character at a time."""
    from specd.grammar.compiler import GrammarCompilerCache

    return GrammarCompilerCache.from_model_dir(tiny_models["target-qwen3_5-mtp"])


@pytest.mark.parametrize("prefix", ["", '{"fn": "x", "hasEmail": "mailto:keystr', '{"fn": "x", "hasEmail": "mailto:a@',
                                    '{"fn": "x", "hasEmail": "mailto:a@b', '{"fn": "x", "hasEmail": "mailto:a@b.'])
def test_walk_leaves_a_class_that_holds_its_own_terminator(qwen_cache, load_schema, prefix):
    """Github_easy/o83161's `@[\\w.-]+\\.[\\w.-]+?`: after `@` the mask stays the same until a `.` and
    one more character have come, so no single token changes it, and a walk looking one token
    ahead would repeat its first pick (`Z`) for ever: no suffix, no closing, the response runs out
    of tokens."""
    schema = load_schema("Github_easy/o83161.json")
    grammar = qwen_cache.sequence_grammar(GrammarSpec("json_schema", json.dumps(schema)))
    info = qwen_cache.tokenizer_info
    spelled = {bytes(t): i for i, t in enumerate(info.decoded_vocab) if len(t) == 1}
    grammar.commit([spelled[bytes([b])] for b in prefix.encode()])  # one byte at a time
    suffix = closing_suffix(grammar.fork_drafts(), qwen_cache.closing_preference(), 128)
    assert suffix is not None, prefix
    text = prefix.encode() + b"".join(bytes(info.decoded_vocab[t]) for t in suffix[:-1])
    jsonschema.validate(json.loads(text), schema)
    grammar.commit(suffix[:1])  # each pick depends on the state only: the walk goes on as it went
    assert closing_suffix(grammar.fork_drafts(), qwen_cache.closing_preference(), 128) == suffix[1:]


def test_walk_still_repeats_a_token_that_counts_towards_a_bound(cache, tokenizer):
    """`[0-9]{6}`: no digit changes the mask before the sixth, and repeating the first pick gets there."""
    grammar = cache.sequence_grammar(GrammarSpec("regex", r"id-[0-9]{6}-[a-z]+\.(com|org)"))
    prefix = tokenizer.encode("id-", add_special_tokens=False)
    grammar.commit(prefix)
    suffix = closing_suffix(grammar.fork_drafts(), cache.closing_preference(), 64)
    assert suffix is not None
    text = tokenizer.decode(prefix + suffix[:-1])
    assert re.fullmatch(r"id-111111-[a-z]+\.(com|org)", text), text
