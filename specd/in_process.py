"""The in-process API of the seed: `pipeline(model_path, backend_config, speculative_config)`.

    from specd import pipeline, PytorchEngineConfig
    from specd.messages import SpeculativeConfig
    pipe = pipeline(path, backend_config=PytorchEngineConfig(max_batch_size=128),
                    speculative_config=SpeculativeConfig(method="eagle3", num_speculative_tokens=3,
                                                         model=draft_path))
    responses = pipe(["Hi, pls intro yourself", "Shanghai is"])
"""

from __future__ import annotations

from typing import Any

from specd.messages import ConfigError, GenerationConfig, PytorchEngineConfig, Response, SpeculativeConfig
from specd.sampling_params import SamplingParams

Prompt = str | list[dict[str, Any]]


class Pipeline:
    """Tokenize, run the speculative engine to completion, detokenize."""

    def __init__(self, model_path: str, backend_config: PytorchEngineConfig | None = None,
                 speculative_config: SpeculativeConfig | None = None, **_: Any) -> None:
        from specd.engine.builder import build_engine
        from specd.models.loader import load_tokenizer
        from specd.models.model_path import resolve_model_path

        self.backend_config = backend_config or PytorchEngineConfig()
        self.speculative_config = speculative_config
        self.model_path = resolve_model_path(model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.engine = build_engine(self.model_path, self.backend_config, speculative_config,
                                   tokenizer=self.tokenizer)

    def __call__(self, prompts: Prompt | list[Prompt],
                 gen_config: GenerationConfig | list[GenerationConfig] | None = None,
                 do_preprocess: bool = True, **_: Any) -> Response | list[Response]:
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                              and isinstance(prompts[0], dict))
        batch = [prompts] if single else list(prompts)
        if isinstance(gen_config, list):
            if len(gen_config) != len(batch):
                raise ConfigError(f"gen_config: {len(gen_config)} configs for {len(batch)} prompts")
            gens = gen_config
        else:
            gens = [gen_config or GenerationConfig()] * len(batch)
        token_ids = [self.encode(p, do_preprocess) for p in batch]
        grammars = [self._grammar(g.response_format) for g in gens]
        seqs = self.engine.generate(token_ids, [SamplingParams.from_generation_config(g) for g in gens], grammars)
        responses = [self._response(s, i) for i, s in enumerate(seqs)]
        return responses[0] if single else responses

    infer = __call__

    def encode(self, prompt: Prompt, do_preprocess: bool = True) -> list[int]:
        """Chat messages and (with do_preprocess, as lmdeploy) strings go through the chat template."""
        if isinstance(prompt, str) and not (do_preprocess and self.tokenizer.chat_template):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
            raise ConfigError("prompts: expected a string or a list of {'role', 'content'} messages")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _grammar(self, response_format: dict | None):
        """Parse and compile-check response_format; the local grammar backend starts on first use."""
        from specd.grammar.response_format import parse_response_format

        spec = parse_response_format(response_format)
        if spec is None:
            return None
        if self.engine.constraints.backend is None:
            from specd.grammar.compiler import GrammarCompilerCache
            from specd.grammar.local import LocalGrammarBackend

            self._grammar_cache = GrammarCompilerCache(self.tokenizer, self.engine.runner.info.vocab_size,
                                                       eos_token_ids=self.engine.runner.info.eos_token_ids)
            self.engine.constraints.backend = LocalGrammarBackend(self._grammar_cache)
            if self.engine.proposer is not None and hasattr(self.engine.proposer, "draft_constraints"):
                from specd.proposers.draft_constraints import DraftConstraints

                self.engine.proposer.draft_constraints = DraftConstraints(self._grammar_cache)
        self._grammar_cache.validate(spec)
        return spec

    def _response(self, seq, index: int) -> Response:
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        if seq.finish_reason == "stop" and seq.params.stop_words and not seq.params.include_stop_str_in_output:
            cuts = [text.find(w) for w in seq.params.stop_words if w and w in text]
            if cuts:
                text = text[:min(cuts)]
        return Response(text=text, generate_token_len=seq.num_output_tokens,
                        input_token_len=len(seq.prompt_token_ids), finish_reason=seq.finish_reason,
                        token_ids=list(seq.output_token_ids), index=index,
                        spec_stats=seq.stats if self.engine.proposer is not None else None,
                        logprobs=_lmdeploy_logprobs(seq) if seq.params.logprobs is not None else None)


def _lmdeploy_logprobs(seq) -> list[dict[int, float]]:
    """lmdeploy's Response.logprobs: per output token {token_id: logprob}, the chosen token first,
    then its top alternatives (a dict: an alternative that is the chosen token is not repeated)."""
    out = []
    for token, entry in zip(seq.output_token_ids, seq.output_logprobs):
        if entry is None:  # not produced here (a resumed request's earlier tokens)
            out.append({})
            continue
        out.append({token: entry.logprob, **{t: lp for t, lp in entry.top if t != token}})
    return out
