"""vLLM's token-in/token-out HTTP API (vLLM 0.32's `vllm/entrypoints/scale_out/`) on the gateway.

The render endpoints answer a chat or a prompt as vLLM's `GenerateRequest` JSON, the generate
endpoint takes that JSON (token ids in) and answers token ids out, the derender endpoints turn
a generate response into OpenAI's chat or completion answer, and abort stops a generate by id.
Each module is one step: `generate_in` (vLLM's request JSON -> the engine's GenerateRequest),
`generate_out` (the engine's responses -> vLLM's JSON), `render_out` (render's response ->
vLLM's GenerateRequest JSON), `messages_in` / `responses_in` (Anthropic's Messages and OpenAI's
Responses bodies -> the chat vLLM renders for them), `derender_in` (vLLM's derender bodies ->
derender's stream), `derender_stream` (the streamed derender's chunk and sealed `stream_state`),
`reuse` (the chat's `kv_transfer_params.prompt_token_ids` and `prompt_features`), `chat_extras`
(the chat's vLLM parameters: prefill/decode's `kv_transfer_params`, `echo`), `media`
(`content_parts` placed in the ids, item metadata kept by hash), `mm_serde` (vLLM's serialized
media items, where vLLM is installed), `shapes` (vLLM's error JSON), `routes` (the HTTP handlers)."""
