"""Rollout generation: the engine protocol (``base``), the HF and vLLM engines, the backend factory."""
