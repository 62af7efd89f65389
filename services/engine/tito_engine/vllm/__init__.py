"""The vllm backend: vLLM's AsyncLLM behind tito's EngineService (`tito serve engine --backend vllm`)."""
