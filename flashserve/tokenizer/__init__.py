"""Text to token ids and back: the tokenizer (Hugging Face and GGUF vocabularies), chat
templates, the incremental detokenizer, checks on text from outside."""
