"""The endpoint engine: an OpenAI-compatible server (vLLM, SGLang, TGI, llama.cpp) audited as a
black box: async client, the solo / concurrent / solo-again audit, a local server by PID."""
