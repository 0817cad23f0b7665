"""Evaluation of dense and compressed models: perplexity (GPTQ/SVD-LLM protocol) and zero-shot accuracy."""
