"""The verifier's clients of the drafter and grammar services (the gateway validates grammars
through the grammar client too): everything on this side of those two gRPC hops.

errors.py         one error hierarchy for both services: unavailable (fall back, reconnect) or
                  rejected (a bug on this side), each a drafter or a grammar error
channel.py        channel options and how a channel is opened (TLS or plaintext)
step_stream.py    one long-lived step RPC over sync gRPC: request queue, reader thread, deadline
grammar.py        RemoteGrammarBackend: the GrammarBackend contract over the grammar service
drafter.py        RemoteProposer: the Proposer contract over one or more drafter services
drafter_stream.py one drafter connection: Info, then the steps on the fast socket or gRPC
draft_step.py     a drafting step as the wire's DraftStepRequest
membership.py     which drafters serve: the hash ring, failover, reconnects, rebalancing
discovery.py      re-resolving the drafter names off the step's path

Layering: specd/ never imports services/; both services/verifier and services/gateway import
these, so they live here rather than under one service.
"""
