"""A Triton replica as an NVIDIA Dynamo worker (`inflight dynamo-worker`), for Dynamo's KV-aware router.

Dynamo's frontend serves the OpenAI API, applies the chat template and tokenizes; its KV router picks the
replica that already caches the longest prefix of the prompt's token ids, from the KV events every engine
publishes. The worker (`worker.py`, a Dynamo `LLMEngine`) sends those token ids to its replica's tritonserver
over gRPC streaming (`input_ids`, output `token_ids`: no detokenize/retokenize round trip, so the ids the
router hashes are exactly the ids the engine caches) and hands Dynamo the replica's ZMQ KV-event endpoint
(vLLM's wire format, `kv_events_config`), which Dynamo's own ZMQ source subscribes to.

Like the OpenAI front it is a Triton client: it never imports the engine (import-linter contract).
`request.py` maps Dynamo's request to the model's `sampling_parameters` and needs no Dynamo install.
"""
