"""Model code: the decoder (toy and Llama/Qwen2 family), loaders, tokenizers, sharding."""
