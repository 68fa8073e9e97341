"""Structured output: grammars (JSON schema, JSON object, regex, EBNF) that constrain decoding.

backend.py          the contract between the engine and whoever holds the matchers
response_format.py  OpenAI / lmdeploy `response_format` -> GrammarSpec, and the wire form of a spec
compiler.py         GrammarSpec -> xgrammar CompiledGrammar, once per spec (bounded LRU)
matcher.py          one sequence's matcher: commit accepted tokens, mask along drafts, draft forks
allowed_rows.py     the token rows ANDed into every mask: what xgrammar admits but no valid output holds
budget.py           budget-aware closing: shape the rows near the end of max_tokens so the output ends
closing.py          the closing walk: a short completion from a grammar state to termination
local.py            LocalGrammarBackend: the contract in-process
masking.py          pure tensor functions: apply a bitmask to logits, translate it to a draft vocab

Nothing is imported here so that `specd.grammar.backend` stays free of xgrammar.
"""
