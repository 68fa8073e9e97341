"""The grammar service: xgrammar matchers for structured output, shared by verifiers over gRPC."""
