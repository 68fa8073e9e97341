"""The verifier's result pipeline: what a step emits, on its way to the result streams.

pipeline.py  ResultPipeline: the loop's emit verb; a step's results become token deltas and
             finals (a request's first token as soon as its prefill sampled it), and the answers
             of the commands riding the same round trip are applied
flush.py     ResultQueue: the queued entries and acknowledgements; one pipelined Redis round trip
             (a ResultFlush) per step, which PipelineRiders (heartbeat, cancel poll, request read) share
writer.py    ResultWriter: that round trip on a thread of its own, overlapping the next step
"""
