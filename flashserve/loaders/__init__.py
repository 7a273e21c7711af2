"""Weight sources: Hugging Face directories (``hf``) and GGUF files (``gguf``).

Each yields ``(Hugging Face tensor name, tensor)`` pairs one at a time, for
``DecoderForCausalLM.load_weights``; ``flashserve.loaders.load`` picks the source.
"""
